"""Each record format's tables: where its records land in bronze and silver, and their contracts."""

from __future__ import annotations

from dataclasses import dataclass

import pandera.polars as pa
from dagster import AssetKey

from pipeline_assets.contracts import BronzePreferenceRecord, BronzeRecord, SilverPreferencePair, SilverRecord
from pipeline_assets.defs.keys import BRONZE_PREFERENCE_RECORDS, BRONZE_RECORDS, SILVER_PREFERENCE_PAIRS, SILVER_RECORDS
from pipeline_assets.lib.formats import PREFERENCE, SFT, RecordFormat


@dataclass(frozen=True)
class FormatTables:
    fmt: RecordFormat
    bronze: AssetKey
    bronze_contract: type[pa.DataFrameModel]
    silver: AssetKey
    silver_contract: type[pa.DataFrameModel]


SFT_TABLES = FormatTables(SFT, BRONZE_RECORDS, BronzeRecord, SILVER_RECORDS, SilverRecord)
PREFERENCE_TABLES = FormatTables(PREFERENCE, BRONZE_PREFERENCE_RECORDS, BronzePreferenceRecord, SILVER_PREFERENCE_PAIRS,
                                 SilverPreferencePair)
FORMAT_TABLES = (SFT_TABLES, PREFERENCE_TABLES)
