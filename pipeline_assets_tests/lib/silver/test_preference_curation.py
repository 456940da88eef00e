"""Silver's curation of preference pairs: every rule of the pair path, on
lib.silver.curation.curate."""

from __future__ import annotations

import json
import random
from functools import partial

import polars as pl
import pytest

from pipeline_assets.lib.formats import PREFERENCE, SFT, TURNS
from pipeline_assets.lib.silver.curation import SilverConfig, curate, curate_formats
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import PROMPT_BAND, lookup_in
from pipeline_assets.lib.stages import run_in_process
from pipeline_assets_tests.lib.silver.test_curation_blocks import (
    assert_every_stage_accounts_for_its_rows,
)
from pipeline_assets_tests.lib.silver.test_dedup import WORDS, _edited

EVAL_ANSWER = " ".join(f"benchmark{i}" for i in range(20))


def _text(rng: random.Random, words: tuple[int, int] = (30, 80)) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))


def _pairs(rows: list[dict], batch_id: str = "b1", first_id: int = 0) -> pl.DataFrame:
    """Bronze preference rows: prompt, chosen, rejected and scores from ``rows``, the rest
    filled in."""
    return pl.DataFrame(
        [
            {
                "record_id": f"{batch_id}-{first_id + i:05d}",
                "batch_id": batch_id,
                "source": "prefs",
                "system": None,
                "prompt_messages": None,
                "score_chosen": None,
                "score_rejected": None,
                **row,
            }
            for i, row in enumerate(rows)
        ],
        schema_overrides={
            "system": pl.String,
            "prompt_messages": TURNS,
            "score_chosen": pl.Float64,
            "score_rejected": pl.Float64,
        },
    )


def _clean(n: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": f"Question {seed}-{i}: {_text(rng, (8, 15))}?",
            "chosen": _text(rng),
            "rejected": _text(rng),
            "score_chosen": 2.0,
            "score_rejected": 1.0,
        }
        for i in range(n)
    ]


def _eval_index() -> EvalNgramIndex:
    return EvalNgramIndex.build(
        pl.DataFrame(
            {
                "eval_set": ["bench"],
                "item_id": ["1"],
                "prompt": ["What?"],
                "response": [EVAL_ANSWER],
            }
        )
    )


def _curate(bronze: pl.DataFrame, earlier=None, **config):
    look_up = lookup_in(earlier.index.lazy()) if earlier is not None else None
    return curate(bronze, look_up, _eval_index(), SilverConfig(**config), fmt=PREFERENCE)


def _stage_of(curated, record_id: str) -> str | None:
    found = curated.rejects.filter(pl.col("record_id") == record_id)
    return found["stage"][0] if found.height else None


def _evidence(curated, record_id: str) -> dict:
    return json.loads(curated.rejects.filter(pl.col("record_id") == record_id)["evidence"][0])


def test_pairs_that_teach_no_preference_are_rejected_with_their_reason():
    rows = _clean(8)
    rows[1] = {
        **rows[1],
        "rejected": "  " + rows[1]["chosen"].replace(" ", "\t ", 3) + "\r\n",
    }  # equal once normalized
    rows[2] = {**rows[2], "score_rejected": 2.0}  # a tie
    rows[3] = {**rows[3], "chosen": "\x07\x08"}  # empty once control characters are stripped
    rows[4] = {**rows[4], "score_chosen": None, "score_rejected": None}  # no scores: not a tie
    curated = _curate(_pairs(rows))
    assert _stage_of(curated, "b1-00001") == "pair:same_answer"
    assert _stage_of(curated, "b1-00002") == "pair:tie"
    assert _evidence(curated, "b1-00002")["score_chosen"] == 2.0
    assert _stage_of(curated, "b1-00003") == "pair:empty_side"
    assert _stage_of(curated, "b1-00004") is None
    assert curated.kept.height + curated.rejects.height == 8
    assert curated.stages["pair_sides"]["rejected_by_reason"] == {
        "pair:same_answer": 1,
        "pair:tie": 1,
        "pair:empty_side": 1,
    }


def test_exact_and_near_dedup_judge_the_whole_pair():
    rng = random.Random(9)
    rows = _clean(6)
    rows.append(dict(rows[0]))  # the same pair again: an exact duplicate
    rows.append(
        {**rows[1], "rejected": _text(rng)}
    )  # one prompt and chosen, another rejected: a pair of its own
    long = {
        "prompt": "Explain " + _text(rng, (60, 60)),
        "chosen": _text(rng, (80, 80)),
        "rejected": _text(rng, (80, 80)),
    }
    rows.append(long)
    rows.append(
        {**long, "chosen": _edited(long["chosen"], rng), "prompt": _edited(long["prompt"], rng)}
    )  # near duplicate
    curated = _curate(_pairs(rows))
    assert _stage_of(curated, "b1-00006") == "exact_dup"
    assert _evidence(curated, "b1-00006")["duplicate_of"] == "b1-00000"
    assert _stage_of(curated, "b1-00007") is None
    assert _stage_of(curated, "b1-00009") == "near_dup"
    assert (
        curated.rejects.filter(pl.col("record_id") == "b1-00009")["duplicate_of"][0] == "b1-00008"
    )


def test_a_pair_labelled_both_ways_loses_both_sides_in_a_batch_and_the_new_side_across_batches():
    rows = _clean(5)
    rows.append({**rows[0], "chosen": rows[0]["rejected"], "rejected": rows[0]["chosen"]})
    first = _curate(_pairs(rows))
    assert {_stage_of(first, "b1-00000"), _stage_of(first, "b1-00005")} == {"contradiction"}
    assert _evidence(first, "b1-00000") == {
        "labelled_the_other_way_by": "b1-00005",
        "in_batch": "b1",
    }
    assert _evidence(first, "b1-00005") == {
        "labelled_the_other_way_by": "b1-00000",
        "in_batch": "b1",
    }

    flipped = {**rows[1], "chosen": rows[1]["rejected"], "rejected": rows[1]["chosen"]}
    later = _curate(_pairs([flipped, *_clean(2, seed=4)], batch_id="b2"), earlier=first)
    assert _stage_of(later, "b2-00000") == "contradiction"
    assert _evidence(later, "b2-00000") == {
        "labelled_the_other_way_by": "b1-00001",
        "in_batch": "b1",
    }
    assert later.stages["contradiction"]["against_other_batches"] == 1
    assert later.kept.height == 2


def test_pairs_of_one_prompt_are_capped_counting_what_earlier_batches_kept():
    rng = random.Random(2)
    prompt = "Which of these answers explains generators better?"
    many = [{"prompt": prompt, "chosen": _text(rng), "rejected": _text(rng)} for _ in range(11)]
    first = _curate(_pairs([*many, *_clean(3)]))
    capped = first.rejects.filter(pl.col("stage") == "pair_cap")
    assert capped["record_id"].to_list() == [
        "b1-00008",
        "b1-00009",
        "b1-00010",
    ]  # the smallest record ids stay
    assert first.kept.filter(pl.col("prompt") == prompt).height == 8
    assert first.stages["pair_cap"]["prompts_capped"] == 1

    fewer = _curate(_pairs(many[:6]))
    more = [{"prompt": prompt, "chosen": _text(rng), "rejected": _text(rng)} for _ in range(4)]
    later = _curate(_pairs(more, batch_id="b2"), earlier=fewer)
    assert later.rejects["stage"].to_list() == ["pair_cap", "pair_cap"]
    assert _evidence(later, "b2-00002")["earlier_pairs"] == 6


def test_decontamination_reads_the_prompt_and_both_answers_and_quality_judges_chosen():
    rows = _clean(6)
    rows[0] = {**rows[0], "rejected": f"As the benchmark says: {EVAL_ANSWER}."}
    rows[1] = {**rows[1], "chosen": "ok"}
    rows[2] = {**rows[2], "rejected": "ok"}
    curated = _curate(_pairs(rows))
    assert _stage_of(curated, "b1-00000") == "decontaminated"
    assert (
        json.loads(curated.rejects.filter(pl.col("record_id") == "b1-00000")["evidence"][0])[
            "field"
        ]
        == "rejected"
    )
    assert _stage_of(curated, "b1-00001").startswith("quality:")
    assert _stage_of(curated, "b1-00002") is None


def _turns(*contents: str) -> list[dict]:
    """Turns alternating user and assistant, the first a user turn."""
    return [
        {"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(contents)
    ]


def test_a_conversational_pairs_earlier_turns_are_part_of_its_prompt_in_every_rule():
    rng = random.Random(4)
    question = "And which of them would you pick for a small team?"
    contexts = [_turns(f"I compare tools for task {k}.", _text(rng, (20, 30))) for k in range(4)]
    rows = [
        *(
            {"prompt_messages": turns, "prompt": question, "chosen": _text(rng), "rejected": "No."}
            for turns in contexts
        ),
        {"prompt": question, "chosen": _text(rng), "rejected": "No."},  # no earlier turns
    ]
    rows += [
        {**rows[0], "prompt_messages": contexts[0] + []},  # the same pair: an exact duplicate
        {**rows[1], "chosen": rows[1]["rejected"], "rejected": rows[1]["chosen"]},  # flipped
        {**rows[2], "prompt_messages": _turns(f"Task 2. {EVAL_ANSWER}", "Noted.")},
        *({**rows[3], "chosen": _text(rng)} for _ in range(8)),  # nine pairs of one context
    ]
    curated = _curate(_pairs(rows))

    stages = dict(curated.rejects.select("record_id", "stage").iter_rows())
    assert stages == {
        "b1-00005": "exact_dup",
        "b1-00001": "contradiction",
        "b1-00006": "contradiction",
        "b1-00007": "decontaminated",
        "b1-00015": "pair_cap",
    }
    assert _evidence(curated, "b1-00007")["field"] == "prompt_messages[0]"
    kept = curated.kept.sort("record_id")
    assert kept["prompt_hash"][:4].n_unique() == 4, "one question after other turns: other prompts"
    assert kept["prompt_messages"].to_list()[:2] == [contexts[0], contexts[2]]
    assert "prompt_messages" in curated.rejects.columns


def test_a_length_ratio_beyond_four_is_counted_and_rejected_only_when_a_limit_is_set():
    rows = _clean(4)
    rows[0] = {
        **rows[0],
        "chosen": _text(random.Random(1), (200, 200)),
        "rejected": " ".join(rows[0]["rejected"].split()[:10]),
    }
    counted = _curate(_pairs(rows))
    assert counted.stages["pair_sides"]["length_ratio_beyond_4x"] == 1 and counted.kept.height == 4
    assert counted.kept.filter(pl.col("record_id") == "b1-00000")["length_log_ratio"][0] > 1.39
    limited = _curate(_pairs(rows), max_length_ratio=4.0)
    assert _stage_of(limited, "b1-00000") == "pair:length_ratio"


def test_pairs_and_sft_records_never_dedup_against_each_other():
    rows = _clean(4)
    sft = pl.DataFrame(
        [
            {
                "record_id": f"s{i}",
                "batch_id": "b0",
                "source": "synth",
                "system": None,
                "prompt": row["prompt"],
                "response": row["chosen"],
            }
            for i, row in enumerate(rows)
        ],
        schema_overrides={"system": pl.String},
    )
    sft_curated = curate(sft, None, _eval_index(), SilverConfig())
    pairs = _curate(
        _pairs([{**row, "rejected": row["chosen"] + " " + row["rejected"][:20]} for row in rows]),
        earlier=sft_curated,
    )
    assert pairs.rejects.is_empty(), pairs.rejects.select("record_id", "stage", "evidence")
    assert pairs.index_lookup["entries_found"] == 0


def _sft(rows: list[dict], batch_id: str) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "record_id": f"{batch_id}-s{i:05d}",
                "batch_id": batch_id,
                "source": "synth",
                "system": None,
                "prompt": row["prompt"],
                "response": row["chosen"],
            }
            for i, row in enumerate(rows)
        ],
        schema_overrides={"system": pl.String},
    )


def test_a_batch_of_both_formats_looks_up_once_and_each_format_is_judged_as_on_its_own():
    config, eval_index = SilverConfig(), _eval_index()
    earlier_rows, rng = _clean(6), random.Random(9)
    first = curate_formats(
        {SFT: _sft(earlier_rows, "b1"), PREFERENCE: _pairs(earlier_rows)}, None, eval_index, config
    )
    index = pl.concat([curated.index for curated in first.formats.values()]).lazy()
    edited = {**earlier_rows[1], "chosen": _edited(earlier_rows[1]["chosen"], rng)}
    copies = [earlier_rows[0], edited, *_clean(4, seed=5)]
    later = {SFT: _sft(copies, "b2"), PREFERENCE: _pairs(copies, batch_id="b2")}
    asked = []

    def counting(wanted: pl.DataFrame, also: pl.DataFrame | None = None) -> pl.DataFrame:
        asked.append(wanted)
        return lookup_in(index)(wanted, also)

    together = curate_formats(later, counting, eval_index, config)
    (wanted,) = asked
    assert (
        PROMPT_BAND in wanted["band"].to_list() and together.index_lookup["keys"] == wanted.height
    )
    for fmt, bronze in later.items():
        alone = curate(bronze, lookup_in(index), eval_index, config, fmt=fmt)
        judged = together.formats[fmt]
        assert judged.kept.equals(alone.kept) and judged.rejects.equals(alone.rejects), fmt.name
        assert (
            judged.index_lookup == alone.index_lookup and alone.index_lookup["entries_found"] == 2
        ), fmt.name
        assert "exact_dup" in judged.rejects["stage"].to_list(), fmt.name


@pytest.mark.parametrize("rows_per_block", [3, 7])
def test_blocks_of_any_size_give_the_pairs_judged_whole(rows_per_block):
    rows = _clean(20)
    rows[4] = {**rows[4], "score_rejected": 2.0}
    rows.append({**rows[2], "chosen": rows[2]["rejected"], "rejected": rows[2]["chosen"]})
    bronze = _pairs(rows)
    whole = _curate(bronze)
    blocked = curate(
        bronze,
        None,
        _eval_index(),
        SilverConfig(),
        partial(run_in_process, rows_per_block=rows_per_block),
        fmt=PREFERENCE,
    )
    assert blocked.kept.equals(whole.kept) and blocked.rejects.equals(whole.rejects)
    assert set(whole.kept.columns) >= {
        "prompt_hash",
        "length_log_ratio",
        "exact_hash",
        "cluster_id",
        "q_words",
    }
    assert "flipped_hash" not in whole.kept.columns and "flipped_hash" not in whole.rejects.columns


def test_every_stage_of_a_batch_of_pairs_counts_its_rows_and_seconds():
    rng = random.Random(9)
    rows = _clean(12)
    rows[4] = {**rows[4], "score_rejected": 2.0}  # a tie
    rows[5] = {**rows[5], "chosen": "ok"}  # too short for the quality gate
    rows[6] = {**rows[6], "rejected": f"As the benchmark says: {EVAL_ANSWER}."}
    rows.append({**rows[2], "chosen": rows[2]["rejected"], "rejected": rows[2]["chosen"]})
    rows.append(dict(rows[0]))  # an exact duplicate
    long = {
        "prompt": "Explain " + _text(rng, (60, 60)),
        "chosen": _text(rng, (80, 80)),
        "rejected": _text(rng, (80, 80)),
    }
    near = {**long, "chosen": _edited(long["chosen"], rng), "prompt": _edited(long["prompt"], rng)}
    prompt = "Which of these answers explains generators better?"
    capped = [{"prompt": prompt, "chosen": _text(rng), "rejected": _text(rng)} for _ in range(10)]
    bronze = _pairs([*rows, long, near, *capped])
    curated = curate(
        bronze,
        None,
        _eval_index(),
        SilverConfig(),
        partial(run_in_process, rows_per_block=5),
        fmt=PREFERENCE,
    )
    removing = (
        "pair_sides",
        "exact_dedup",
        "contradiction",
        "near_dedup",
        "decontaminate",
        "quality",
        "pair_cap",
    )
    assert list(curated.stages) == [
        "normalize",
        *removing[:1],
        "views",
        "minhash",
        *removing[1:-1],
        "language",
        *removing[-1:],
    ]
    assert_every_stage_accounts_for_its_rows(curated, bronze)
    assert all(curated.stages[name]["rejected"] > 0 for name in removing)
