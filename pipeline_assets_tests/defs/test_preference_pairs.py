"""Preference pairs through Dagster: a preference source curated in silver beside an sft one, batch
after batch, then packed into gold/preference_sequences."""

from __future__ import annotations

import json
import random

import polars as pl
from dagster import SkipReason, build_sensor_context, materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.gold.assets import gold_tokenizer
from pipeline_assets.defs.gold.cadence import PREFERENCE_SERIES, snapshot_decision
from pipeline_assets.defs.gold.manifest import gold_preference_snapshots
from pipeline_assets.defs.gold.preference import gold_preference_sequences
from pipeline_assets.defs.gold.sensors import preference_snapshot_cadence
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.manifest import (
    PREFERENCE_SNAPSHOTS,
    read_manifest,
    sequences_scan,
)
from pipeline_assets.lib.silver.dedup import BAND_SCHEMA, PROMPT_BAND, band_entries
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets.sample_data.preferences import add_preference_source
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, register
from pipeline_assets_tests.lib.silver.test_dedup import WORDS

CAPPED_PROMPT = "Which of these two answers explains Python generators better?"


def _answer(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60))) + "."


def _pairs(first: int, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "id": f"p{first + i}",
            "prompt": f"Question {first + i}: how does part {first + i} work?",
            "chosen": _answer(rng),
            "rejected": _answer(rng),
            "score_chosen": 8,
            "score_rejected": 3,
        }
        for i in range(n)
    ]


UPSTREAM = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]


def _materialize(instance, resources, batch_id, assets=UPSTREAM, selection=None):
    prefs = LandingResource(uri=resources["landing"].uri, source_formats={"prefs": "preference"})
    return materialize(
        assets,
        partition_key=batch_id,
        instance=instance,
        resources={**resources, "landing": prefs},
        raise_on_error=False,
        selection=selection,
    )


def _by_id(lake, table: str) -> dict[str, dict]:
    ids = dict(lake.read("bronze", "preference_records").select("record_id", "id").iter_rows())
    return {
        ids[row["record_id"]]: row
        for row in lake.read("silver", table).iter_rows(named=True)
        if row["record_id"] in ids
    }


def test_preference_pairs_are_curated_beside_sft_records_and_against_earlier_batches(
    instance, resources, landing_dir
):
    rng = random.Random(7)
    pairs = _pairs(0, 12, seed=1)
    first = [
        *pairs,
        {**pairs[0], "id": "dup"},
        {**pairs[1], "id": "tie", "score_rejected": 8},
        {**pairs[2], "id": "same", "rejected": pairs[2]["chosen"] + "  "},
        {**pairs[3], "id": "flip", "chosen": pairs[3]["rejected"], "rejected": pairs[3]["chosen"]},
        *(
            {
                "id": f"cap{i}",
                "prompt": CAPPED_PROMPT,
                "chosen": _answer(rng),
                "rejected": _answer(rng),
            }
            for i in range(6)
        ),
    ]
    write_landing_file(
        landing_dir, "annotate", "a.jsonl", [record(i, response=_answer(rng)) for i in range(10)]
    )
    write_landing_file(landing_dir, "prefs", "p1.jsonl", first)
    batch1 = register(instance, resources)
    result = _materialize(instance, resources, batch1)
    assert result.success, [
        e.event_specific_data.error.message for e in result.get_step_failure_events()
    ]

    lake = resources["lake"]
    stages = {i: row["stage"] for i, row in _by_id(lake, "rejects").items()}
    assert stages == {
        "dup": "exact_dup",
        "tie": "pair:tie",
        "same": "pair:same_answer",
        "p3": "contradiction",
        "flip": "contradiction",
    }
    assert lake.read("silver", "records").height == 10, "the sft records go their own way"
    assert lake.read("silver", "preference_pairs").height == 12 - 1 + 6
    checks = checks_by_name(result)
    for name in (
        "silver/preference_pairs:contract",
        "silver/rejects:contract",
        "silver/records:pass_rate",
    ):
        assert checks[name].passed, (name, checks[name].description)
    metadata = {
        m.asset_key.to_user_string(): m.metadata
        for m in result.asset_materializations_for_node("silver")
    }
    pairs_meta = metadata["silver/preference_pairs"]
    assert (
        pairs_meta["bronze_rows"].value,
        pairs_meta["silver_rows"].value,
        pairs_meta["rejected_rows"].value,
    ) == (22, 17, 5)
    assert pairs_meta["upstream_delta_versions"].value["bronze/preference_records"] == lake.version(
        "bronze", "preference_records"
    )
    assert metadata["silver/records"]["silver_rows"].value == 10

    second = [
        {
            **pairs[5],
            "id": "flip-later",
            "chosen": pairs[5]["rejected"],
            "rejected": pairs[5]["chosen"],
        },
        {**pairs[6], "id": "dup-later"},
        *(
            {
                "id": f"cap-later{i}",
                "prompt": CAPPED_PROMPT,
                "chosen": _answer(rng),
                "rejected": _answer(rng),
            }
            for i in range(4)
        ),
        *_pairs(100, 12, seed=2),
    ]  # enough clean pairs that the pass rate holds
    write_landing_file(landing_dir, "prefs", "p2.jsonl", second)
    batch2 = register(instance, resources)
    later = _materialize(instance, resources, batch2)
    assert later.success, [
        e.event_specific_data.error.message for e in later.get_step_failure_events()
    ]

    rejects = _by_id(lake, "rejects")
    assert json.loads(rejects["flip-later"]["evidence"])["in_batch"] == batch1
    assert rejects["dup-later"]["stage"] == "exact_dup"
    capped = sorted(i for i, row in rejects.items() if row["stage"] == "pair_cap")
    assert len(capped) == 2 and all(i.startswith("cap-later") for i in capped), (
        "6 kept before, 8 a prompt"
    )
    assert json.loads(rejects[capped[0]]["evidence"])["earlier_pairs"] == 6
    kept = lake.read("silver", "preference_pairs")
    assert kept.filter(pl.col("prompt") == CAPPED_PROMPT).height == 8
    assert (
        kept["prompt_hash"].n_unique() == kept.filter(pl.col("prompt") != CAPPED_PROMPT).height + 1
    )
    bands = lake.read("silver", "minhash_bands")
    assert bands.filter(pl.col("band") == PROMPT_BAND).height == kept.height, (
        "a prompt key a kept pair"
    )
    index = lake.read("silver", "minhash_index")
    assert (
        bands.select(BAND_SCHEMA.names())
        .sort("band", "record_id")
        .equals(band_entries(index).sort("band", "record_id"))
    ), "the tasks a band wrote the rows the index's entries make, the prompt band's included"


def test_each_batch_of_pairs_is_packed_a_pair_a_unit_with_a_prompt_on_one_side(
    instance, resources, landing_dir, tmp_path
):
    rng = random.Random(3)
    many = [
        {
            "id": f"same-prompt{i}",
            "prompt": CAPPED_PROMPT,
            "chosen": _answer(rng),
            "rejected": _answer(rng),
        }
        for i in range(5)
    ]
    too_long = {
        "id": "too-long",
        "prompt": "Tell me everything.",
        "chosen": " ".join(_answer(rng) for _ in range(14)),
        "rejected": _answer(rng),
    }
    write_landing_file(
        landing_dir, "annotate", "a.jsonl", [record(i, response=_answer(rng)) for i in range(30)]
    )
    chats = _chat_pairs(rng)
    write_landing_file(
        landing_dir, "prefs", "p.jsonl", [*_pairs(0, 40, seed=4), *many, too_long, *chats]
    )
    batch = register(instance, resources)
    assert _materialize(instance, resources, batch).success
    assets = [*UPSTREAM, gold_tokenizer, gold_preference_sequences]
    assert _materialize(instance, resources, None, assets, [gold_tokenizer]).success
    result = _materialize(instance, resources, batch, assets, [gold_preference_sequences])
    assert result.success, [
        e.event_specific_data.error.message for e in result.get_step_failure_events()
    ]

    lake = resources["lake"]
    silver_pairs = lake.read("silver", "preference_pairs").select(
        "record_id", "prompt", "prompt_hash"
    )
    rows = lake.read("gold", "preference_sequences")
    packed = rows.select(
        "split", "pair_ids", "document_lengths", "loss_mask", "position_ids"
    ).explode("pair_ids")
    metadata = result.asset_materializations_for_node("gold__preference_sequences")[0].metadata
    assert (
        metadata["pairs_too_long"].value == 1
        and metadata["pairs_left_out"].value.records[0].data["reason"] == "too_long"
    )
    assert packed.height == silver_pairs.height - 1, "every other pair is in exactly one row"
    assert packed["pair_ids"].n_unique() == packed.height
    for row in rows.iter_rows(named=True):
        assert len(row["document_lengths"]) == 2 * len(row["pair_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert len(starts) >= len(row["document_lengths"]), "positions restart at every document"
    sides = (
        packed.join(silver_pairs, left_on="pair_ids", right_on="record_id")
        .group_by("prompt_hash")
        .agg(pl.col("split").n_unique())
    )
    assert sides["split"].max() == 1, "all pairs of one prompt on one side of the split"
    assert set(rows["split"]) == {"train", "validation"}
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["contract"].passed
    _assert_chat_pairs_trained_on_their_answers_alone(lake, chats, rows)

    assert snapshot_decision(instance, batch_gates(), 0.1, PREFERENCE_SERIES).due, (
        "a first shard of pairs: a first preference snapshot"
    )
    registry = {
        "mlflow_tracking": MlflowResource(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
            artifact_root=str(tmp_path / "mlartifacts"),
        ),
        "registry_policy": RegistryPolicy(),
        "gold_policy": resources["gold_policy"],
        "base_model": resources["base_model"],
    }
    sensor_resources = {**registry, "batch_gates": batch_gates()}
    with build_sensor_context(instance=instance, resources=sensor_resources) as context:
        waiting = preference_snapshot_cadence(context)
    assert (
        isinstance(waiting, SkipReason) and "no sft-model champion yet" in waiting.skip_message
    ), "DPO starts from it"
    cut = _materialize(
        instance, resources, None, [*assets, gold_preference_snapshots], [gold_preference_snapshots]
    )
    assert cut.success, [e.event_specific_data.error.message for e in cut.get_step_failure_events()]
    assert instance.get_dynamic_partitions(preference_snapshots.name) == ["dpo-v0"]
    manifest = read_manifest(lake.uri, 0, PREFERENCE_SNAPSHOTS)
    assert manifest.key == "dpo-v0" and manifest.batches == (batch,)
    assert manifest.sequences_by_split() == {
        split: rows.filter(pl.col("split") == split).height
        for split in ("train", "validation", "search")
    }
    in_order = manifest.in_order(sequences_scan(lake.uri, manifest)).collect()
    assert in_order["pair_ids"].explode().sort().to_list() == packed["pair_ids"].sort().to_list()
    assert not snapshot_decision(instance, batch_gates(), 0.1, PREFERENCE_SERIES).due, (
        "nothing new since dpo-v0"
    )


def _chat_pairs(rng: random.Random) -> list[dict]:
    """Pairs in TRL's conversational shape: one last question after two different exchanges (one
    with a system turn), and one whose prompt ends on an assistant turn."""

    def turn(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    def chat(name: str, system: list[dict], part: str, last: dict | None) -> dict:
        prompt = [
            *system,
            turn("user", f"I am planning part {part} of the migration."),
            turn("assistant", f"Good: part {part} moves the tables first."),
        ]
        return {
            "id": name,
            "prompt": [*prompt, last] if last else prompt,
            "chosen": [turn("assistant", _answer(rng))],
            "rejected": [turn("assistant", _answer(rng))],
        }

    question = turn("user", "What should I do next?")
    system = [turn("system", "You help with data migrations.")]
    return [
        chat("chat-a", system, "A", question),
        chat("chat-b", [], "B", question),
        chat("chat-broken", [], "C", None),
    ]


def _assert_chat_pairs_trained_on_their_answers_alone(lake, chats, rows) -> None:
    ids = dict(lake.read("bronze", "preference_records").select("id", "record_id").iter_rows())
    reasons = lake.read("bronze", "quarantine").filter(pl.col("source") == "prefs")["reason"]
    assert "chat-broken" not in ids and reasons.to_list() == ["prompt_ends_on_assistant_turn"]
    kept = (
        lake.read("silver", "preference_pairs")
        .filter(pl.col("record_id").is_in([ids["chat-a"], ids["chat-b"]]))
        .sort("record_id")
    )
    assert kept["prompt"].to_list() == ["What should I do next?"] * 2
    assert kept["prompt_hash"].n_unique() == 2, "other earlier turns: another prompt"
    assert kept["system"].to_list() == ["You help with data migrations.", None]
    spec = EncoderSpec.from_row(lake.read("gold", "tokenizer").row(0, named=True))
    encoder = chat_encoder(spec)
    for chat in chats[:2]:
        (row,) = rows.filter(pl.col("pair_ids").list.contains(ids[chat["id"]])).iter_rows(
            named=True
        )
        k = row["pair_ids"].index(ids[chat["id"]])
        start = sum(row["document_lengths"][: 2 * k])
        for side, length in zip(("chosen", "rejected"), row["document_lengths"][2 * k : 2 * k + 2]):
            document = range(start, start + length)
            trained = [row["input_ids"][i] for i in document if row["loss_mask"][i]]
            context = [row["input_ids"][i] for i in document if not row["loss_mask"][i]]
            assert encoder.decode(trained) == chat[side][0]["content"]
            assert all(t["content"] in encoder.decode(context) for t in chat["prompt"])
            start += length


# Where silver sets aside each defect the sample preference source injects.
EXPECTED_STAGE = {
    "exact_duplicate": "exact_dup",
    "near_duplicate": "near_dup",
    "contradiction": "contradiction",
    "tie": "pair:tie",
    "chosen_equals_rejected": "pair:same_answer",
    "eval_copy": "decontaminated",
    "low_quality": "quality:",
}  # any rule


def test_silver_sets_aside_every_defect_of_the_sample_preference_source(
    instance, resources, landing_dir, eval_sets_dir
):
    write_sample_corpus(landing_dir, records=300, eval_sets_dir=eval_sets_dir)
    section = add_preference_source(landing_dir, 400, eval_sets_dir=eval_sets_dir)["preference"]
    batch = register(instance, resources)
    result = _materialize(instance, resources, batch)
    assert result.success, [
        e.event_specific_data.error.message for e in result.get_step_failure_events()
    ]

    lake = resources["lake"]
    rejects = _by_id(lake, "rejects")
    for kind, stage in EXPECTED_STAGE.items():
        entries = section["injected"][kind]
        assert entries, kind
        for entry in entries:
            actual = rejects[entry["id"]]["stage"]
            assert actual == stage or (stage.endswith(":") and actual.startswith(stage)), (
                kind,
                entry,
                actual,
            )
    originals = {entry["contradicts"] for entry in section["injected"]["contradiction"]}
    assert all(rejects[i]["stage"] == "contradiction" for i in originals), (
        "both sides of a contradiction go"
    )
    capped = [i for i, row in rejects.items() if row["stage"] == "pair_cap"]
    assert len(capped) == section["expected"]["pairs_over_prompt_cap"]
    assert set(capped) <= set(section["prompt_groups"][0])
    kept = _by_id(lake, "preference_pairs")
    clean = set(section["clean_ids"]) - originals - set(capped)
    assert clean <= set(kept), sorted(clean - set(kept))[:5]
    quarantined = lake.read("bronze", "quarantine").filter(pl.col("source") == "prefs")
    assert quarantined.height == section["expected"]["quarantined"]
    assert len(kept) + len(rejects) == section["expected"]["bronze_rows"]


def test_a_batch_of_both_formats_looks_up_the_index_once_and_each_format_dedups_against_its_own(
    instance, resources, landing_dir
):
    rng = random.Random(11)
    records, pairs = [record(i, response=_answer(rng)) for i in range(10)], _pairs(0, 10, seed=5)
    write_landing_file(landing_dir, "annotate", "a1.jsonl", records)
    write_landing_file(landing_dir, "prefs", "p1.jsonl", pairs)
    batch1 = register(instance, resources)
    assert _materialize(instance, resources, batch1).success
    write_landing_file(
        landing_dir,
        "annotate",
        "a2.jsonl",
        [
            {**records[0], "id": "sft-copy"},
            *(record(i, response=_answer(rng)) for i in range(10, 19)),
        ],
    )
    write_landing_file(
        landing_dir, "prefs", "p2.jsonl", [{**pairs[0], "id": "pair-copy"}, *_pairs(100, 9, seed=6)]
    )
    batch2 = register(instance, resources)
    result = _materialize(instance, resources, batch2)
    assert result.success, [
        e.event_specific_data.error.message for e in result.get_step_failure_events()
    ]

    metadata = {
        m.asset_key.to_user_string(): m.metadata
        for m in result.asset_materializations_for_node("silver")
    }
    lookup = {
        name: metadata["silver/records"][name].value
        for name in ("index_lookup_bands", "index_lookup_tasks", "index_entries_found")
    }
    # each format's 16 LSH bands searched by tasks that read its staged keys, and the sft records'
    # exact hashes (they are decided from their candidates), then one round of tasks over the
    # pairs' hashes (the exact hashes' band and the prompts')
    assert lookup == {
        "index_lookup_bands": 35,
        "index_lookup_tasks": "33 band searches; 2 by band, 1 reading entries",
        "index_entries_found": 2,
    }
    lake = resources["lake"]
    first_ids = {
        row["id"]: row["record_id"]
        for table in ("records", "preference_records")
        for row in lake.read("bronze", table)
        .filter(pl.col("batch_id") == batch1)
        .iter_rows(named=True)
    }
    rejects = lake.read("silver", "rejects").filter(pl.col("batch_id") == batch2)
    assert sorted(rejects.select("stage", "duplicate_of").rows()) == sorted(
        [("exact_dup", first_ids["r0"]), ("exact_dup", first_ids["p0"])]
    ), "each format finds its own copy"
