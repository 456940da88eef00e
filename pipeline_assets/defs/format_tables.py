"""Each record format's tables: where its records land in bronze and silver, and their contracts,
made from its description (lib.formats) for every format there is."""

from __future__ import annotations

from dataclasses import dataclass

import pandera.polars as pa
from dagster import AssetKey

from pipeline_assets.contracts import FORMAT_CONTRACTS
from pipeline_assets.lib.formats import FORMATS, PREFERENCE, SFT, RecordFormat


@dataclass(frozen=True)
class FormatTables:
    fmt: RecordFormat
    bronze: AssetKey
    bronze_contract: type[pa.DataFrameModel]
    silver: AssetKey
    silver_contract: type[pa.DataFrameModel]

    @classmethod
    def of(cls, fmt: RecordFormat) -> "FormatTables":
        bronze_contract, silver_contract = FORMAT_CONTRACTS[fmt.name]
        return cls(
            fmt,
            AssetKey(["bronze", fmt.bronze_table]),
            bronze_contract,
            AssetKey(["silver", fmt.silver_table]),
            silver_contract,
        )


FORMAT_TABLES = tuple(FormatTables.of(fmt) for fmt in FORMATS.values())
SFT_TABLES, PREFERENCE_TABLES = FormatTables.of(SFT), FormatTables.of(PREFERENCE)
# the formats packed into gold/sequences and trained together: sft records, conversations
SFT_OBJECTIVE_TABLES = tuple(t for t in FORMAT_TABLES if t.fmt.objective == SFT.objective)
