"""The record-format seam: a third format trained with sft's loss is its description (lib.formats)
and its contracts (contracts.py). A subprocess adds a `qa` format (prompt, answer) the way a new
entry in those two modules would, before the code location loads, and runs `pipeline-assets run`
from landing to gold/sequences: its rows reach bronze/qa_records and silver/qa_records through the
same assets, checks and stages as every format (a copy rejected, a blank answer quarantined), and
are packed into gold/sequences beside the sft records."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import polars as pl

from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.conftest import cli_environment, write_landing_file

ADD_QA_AND_RUN = textwrap.dedent("""
    import sys

    import pandera.polars as pa

    from pipeline_assets import contracts
    from pipeline_assets.lib import formats


    class QaLanding(pa.DataFrameModel):
        prompt: str
        answer: str
        system: str = pa.Field(nullable=True)
        id: str = pa.Field(nullable=True)
        created_at: contracts.UTC_TIMESTAMP = pa.Field(nullable=True)
        meta: str = pa.Field(nullable=True)
        extra: str = pa.Field(nullable=True)

        class Config:
            strict = True
            coerce = False


    class BronzeQa(contracts.Provenance, QaLanding):
        pass


    class SilverQa(contracts.Curated, BronzeQa):
        pass


    formats.FORMATS["qa"] = formats.RecordFormat(
        name="qa", required=("prompt", "answer"), optional_text=("system",), optional_numbers=(),
        dedup=("prompt", "answer"), answers=("answer",), judged="answer",
        decontaminate=("prompt", "answer"), split_key="exact_hash", objective="sft",
        bronze_table="qa_records", silver_table="qa_records", about="question-answer records",
    )
    contracts.FORMAT_CONTRACTS["qa"] = (BronzeQa, SilverQa)

    from pipeline_assets.cli.main import main

    selection = "key:bronze/* or key:silver/* or key:gold/tokenizer or key:gold/sequences"
    sys.exit(main(["run", "--select", selection]))
""")


def _qa(i: int) -> dict:
    return {
        "prompt": f"Which river flows through city number {i} of the northern plains?",
        "answer": f"The river of city {i} is wide and slow; "
        "barges carry grain down it to the harbour at "
        f"the coast every autumn, and the town holds a fair on its banks when the harvest ends.",
        "id": f"qa{i}",
    }


def test_a_third_format_is_its_description_and_its_contracts(tmp_path):
    landing = tmp_path / "landing"
    write_sample_corpus(
        landing, records=300, eval_sets_dir=tmp_path / "reference" / "eval_sets"
    )  # sft records
    rows = [_qa(i) for i in range(30)] + [
        _qa(3),
        {**_qa(99), "answer": "   "},
    ]  # a copy, a blank answer (3%)
    write_landing_file(landing, "trivia", "part-0.jsonl", rows)
    environment = cli_environment(tmp_path, PIPELINE_SOURCE_FORMATS=json.dumps({"trivia": "qa"}))
    done = subprocess.run(
        [sys.executable, "-c", ADD_QA_AND_RUN],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    lake = tmp_path / "lake"
    bronze = pl.read_delta(str(lake / "bronze" / "qa_records"))
    silver = pl.read_delta(str(lake / "silver" / "qa_records"))
    rejects = pl.read_delta(str(lake / "silver" / "rejects")).filter(pl.col("source") == "trivia")
    quarantine = pl.read_delta(str(lake / "bronze" / "quarantine")).filter(
        pl.col("source") == "trivia"
    )
    assert bronze.height == 31 and "answer" in bronze.columns and "response" not in bronze.columns
    assert quarantine["reason"].to_list() == ["empty_field:answer"]
    assert silver.height + rejects.height == bronze.height, "every bronze row kept or rejected"
    assert rejects.filter(pl.col("stage") == "exact_dup").height == 1, "the copy of qa3"
    assert silver["id"].n_unique() == silver.height and {f"qa{i}" for i in range(30)} == set(
        silver["id"]
    )
    assert "trivia" not in set(pl.read_delta(str(lake / "silver" / "records"))["source"]), (
        "sft's tables untouched"
    )
    packed = set(pl.read_delta(str(lake / "gold" / "sequences"))["record_ids"].explode())
    assert set(silver["record_id"]) <= packed, (
        "qa records are packed into gold/sequences with sft's"
    )
