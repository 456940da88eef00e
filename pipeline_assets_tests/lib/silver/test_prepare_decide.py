"""Silver as prepare (per block) -> decide (keys only) -> split equals ``curate_formats`` table for
table, batch after batch, each batch deduplicating against the index entries of those before."""

from __future__ import annotations

import random

import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, PREFERENCE, SFT, TURNS
from pipeline_assets.lib.silver.curation import SilverConfig, curate_formats
from pipeline_assets.lib.silver.decide import decide
from pipeline_assets.lib.silver.dedup import SIGNATURE_COLUMNS, lookup_in
from pipeline_assets.lib.silver.prepare import TextInKeysError, prepare, text_columns
from pipeline_assets.lib.silver.scorers import ScorerSpec
from pipeline_assets.lib.silver.split import split
from pipeline_assets_tests.fasttext_models import EOS, TinyFastText
from pipeline_assets_tests.lib.silver import test_conversation_curation as chats
from pipeline_assets_tests.lib.silver import test_preference_curation as pairs
from pipeline_assets_tests.lib.silver.test_curation_blocks import _bronze, _eval_index
from pipeline_assets_tests.lib.silver.test_dedup import WORDS, _edited

RUNNER_COUNTS = ("rows_in", "kept", "rejected")


def _sft_batches() -> list[pl.DataFrame]:
    """b1: an exact, a near duplicate, a contaminated and a too short record, and a copy of the
    too short one (a duplicate that is low quality too); b2: copies and edits of b1's records, and
    of b1's too short one; b3: a copy of one b2 kept."""
    first = _bronze()
    first = first.with_columns(
        prompt=pl.when(pl.col("record_id") == "r00041")
        .then(pl.lit(first["prompt"][40]))
        .otherwise("prompt"),
        response=pl.when(pl.col("record_id") == "r00041").then(pl.lit("ok")).otherwise("response"),
    )
    rng = random.Random(11)
    responses = [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(30)]
    responses[0], responses[1] = first["response"][5], _edited(first["response"][6], rng)
    responses[2] = "ok"
    prompts = [f"Later question {i}." for i in range(30)]
    prompts[0], prompts[1], prompts[2] = first["prompt"][5], first["prompt"][6], first["prompt"][40]
    second = _sft("b2", "s", prompts, responses)
    third = _sft("b3", "t", [prompts[7], "A new one."], [responses[7], responses[8] + " more"])
    return [first, second, third]


def _sft(batch_id: str, prefix: str, prompts: list[str], responses: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"{prefix}{i:05d}" for i in range(len(prompts))],
            "batch_id": batch_id,
            "source": "synth",
            "system": None,
            "prompt": prompts,
            "response": responses,
        },
        schema_overrides={"system": pl.String},
    )


def _preference_batches() -> list[pl.DataFrame]:
    """b1: a contradiction, one prompt over the cap, an empty side, a tie, an exact copy; b2: a pair
    b1 kept labelled the other way, a copy of one b1 kept, a pair of the capped prompt twice."""
    rng = random.Random(2)
    rows = pairs._clean(6)
    rows.append({**rows[0], "chosen": rows[0]["rejected"], "rejected": rows[0]["chosen"]})
    prompt = "Which of these answers explains generators better?"
    rows += [
        {"prompt": prompt, "chosen": pairs._text(rng), "rejected": pairs._text(rng)}
        for _ in range(11)
    ]
    rows.append({**rows[2], "chosen": "\x07\x08"})  # empty once normalized
    rows.append({**rows[3], "score_rejected": 2.0})  # a tie
    rows.append(dict(rows[4]))  # an exact copy
    flipped = {**rows[1], "chosen": rows[1]["rejected"], "rejected": rows[1]["chosen"]}
    more = [{"prompt": prompt, "chosen": pairs._text(rng), "rejected": pairs._text(rng)}] * 2
    later = [flipped, dict(rows[5]), *more, *pairs._clean(3, seed=4)]
    return [pairs._pairs(rows, "b1"), pairs._pairs(later, "b2")]


def _conversation_batches() -> list[pl.DataFrame]:
    """b1: a copy and a contaminated answer; b2: a copy of a conversation b1 kept."""
    rows = chats._clean(6)
    rows.append(rows[0])
    rows[2] = chats._with_turn(rows[2], 4, f"As the benchmark says: {pairs.EVAL_ANSWER}.")
    later = [rows[1], *chats._clean(3, seed=5)]
    # record ids of their own: ids are unique across formats
    return [
        chats._conversations(chat, batch_id).with_columns(record_id="c" + pl.col("record_id"))
        for chat, batch_id in ((rows, "b1"), (later, "b2"))
    ]


def _batches() -> list[dict]:
    """Three batches in arrival order; the third holds sft records only."""
    by_format = {
        SFT: _sft_batches(),
        PREFERENCE: _preference_batches(),
        CONVERSATION: _conversation_batches(),
    }
    return [
        {fmt: frames[i] for fmt, frames in by_format.items() if i < len(frames)} for i in range(3)
    ]


def _today(batches: list[dict], config: SilverConfig) -> list[dict]:
    index, results = None, []
    for bronze in batches:
        look_up = lookup_in(index.lazy()) if index is not None else None
        curated = curate_formats(bronze, look_up, _eval_index(), config).formats
        results.append({fmt: (c.kept, c.rejects, c.index, c.stages) for fmt, c in curated.items()})
        index = _more(index, [c.index for c in curated.values()])
    return results


def _prepared_decided_split(batches: list[dict], config: SilverConfig, rows_per_block: int):
    index, results = None, []
    for bronze in batches:
        look_up = lookup_in(index.lazy()) if index is not None else None
        prepared = {
            fmt: prepare(frame, config, _eval_index(), fmt, rows_per_block)
            for fmt, frame in bronze.items()
        }
        decisions = decide({fmt: p.keys for fmt, p in prepared.items()}, look_up, config)
        cut = {fmt: split(prepared[fmt], decisions[fmt], config.minhash) for fmt in prepared}
        results.append({fmt: (s.kept, s.rejects, s.index, s.stages) for fmt, s in cut.items()})
        index = _more(index, [s.index for s in cut.values()])
    return results


def _more(index: pl.DataFrame | None, entries: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat([*([index] if index is not None else []), *entries])


def _assert_equal(ours: list[dict], today: list[dict]) -> None:
    for batch, (mine, theirs) in enumerate(zip(ours, today, strict=True)):
        for fmt, (kept, rejects, index, stages) in theirs.items():
            where = f"batch {batch + 1}, {fmt.name}"
            for name, frame, other in zip(
                ("kept", "rejects", "index"), mine[fmt][:3], (kept, rejects, index), strict=True
            ):
                assert frame.columns == other.columns, f"{where}: {name}' columns"
                assert frame.sort("record_id").equals(other.sort("record_id")), f"{where}: {name}"
            assert list(mine[fmt][3]) == list(stages), where
            for stage, counters in stages.items():
                counted = {k: counters[k] for k in RUNNER_COUNTS}
                assert {k: mine[fmt][3][stage][k] for k in RUNNER_COUNTS} == counted, stage


@pytest.mark.parametrize("rows_per_block", [7, 50, 1_000])
def test_prepare_decide_split_equals_curate_formats_table_for_table(rows_per_block):
    batches, config = _batches(), SilverConfig()
    today = _today(batches, config)
    _assert_equal(_prepared_decided_split(batches, config, rows_per_block), today)
    seen = {stage for batch in today for tables in batch.values() for stage in tables[1]["stage"]}
    first = today[0][SFT][1]
    assert first.filter(pl.col("record_id") == "r00041")["stage"].to_list() == ["exact_dup"]
    assert {"exact_dup", "near_dup", "decontaminated", "contradiction", "pair_cap"} <= seen
    assert {"pair:empty_side", "pair:tie"} <= seen and any(s.startswith("quality:") for s in seen)
    later = today[1]
    assert later[PREFERENCE][1]["stage"].to_list().count("contradiction") == 1
    assert "exact_dup" in later[CONVERSATION][1]["stage"].to_list()


def test_keys_hold_no_text_and_decide_refuses_keys_that_do():
    batch, config = _batches()[0], SilverConfig()
    prepared = {fmt: prepare(frame, config, _eval_index(), fmt) for fmt, frame in batch.items()}
    for p in prepared.values():
        assert not set(p.keys.columns) & text_columns()
        assert TURNS not in p.keys.schema.dtypes()
        assert p.keys.height == p.staged.height == batch[p.fmt].height
    keys = {fmt: p.keys for fmt, p in prepared.items()}
    with_text = prepared[SFT].keys.with_columns(prepared[SFT].staged["response"])
    with pytest.raises(TextInKeysError, match="response"):
        decide({**keys, SFT: with_text}, None, config)
    with_turns = prepared[CONVERSATION].keys.with_columns(prepared[CONVERSATION].staged["messages"])
    with pytest.raises(TextInKeysError, match="messages"):
        decide({**keys, CONVERSATION: with_turns}, None, config)
    unsigned = prepared[SFT].keys.drop(SIGNATURE_COLUMNS)
    with pytest.raises(ValueError, match="near dedup's verified pairs"):
        decide({**keys, SFT: unsigned}, None, config)


def _fasttext_scorer(tmp_path) -> ScorerSpec:
    """A fastText model, built by hand, that likes word0..word999 and dislikes word1000..word1999:
    a response of random words scores about 0.5, so ``min`` 0.5 rejects about half of them."""
    words = [f"word{i}" for i in range(2000)]
    side = [[1.0, 0.0]] * 1000 + [[0.0, 1.0]] * 1000 + [[0.0, 0.0]]  # the last: EOS
    model = TinyFastText([*words, EOS], ["__label__good", "__label__bad"], side, [[4, -4], [-4, 4]])
    return ScorerSpec("fluency", str(model.save(tmp_path / "fluency.bin")), min=0.5, label="good")


def test_a_scorer_sees_only_records_the_heuristics_kept_and_the_split_still_equals_today(tmp_path):
    config = SilverConfig(scorers=(_fasttext_scorer(tmp_path),))
    batches = [{SFT: batch[SFT]} for batch in _batches()]
    today = _today(batches, config)
    _assert_equal(_prepared_decided_split(batches, config, 13), today)
    assert any("quality_model" in batch[SFT][1]["stage"].to_list() for batch in today)

    staged = prepare(batches[0][SFT], config, _eval_index(), SFT, 13).staged
    heuristics = pl.col("stage").is_in(["decontaminated", "language"]) | pl.col(
        "stage"
    ).str.starts_with("quality:")
    assert staged.filter(heuristics).height >= 2
    assert (
        staged.filter(heuristics)["score_fluency"].null_count() == staged.filter(heuristics).height
    ), "the scorer was given a record the heuristics rejected"
    assert staged.filter(~heuristics.fill_null(False))["score_fluency"].null_count() == 0
