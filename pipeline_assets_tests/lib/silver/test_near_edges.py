"""Near dedup from verified pairs built a band at a time equals near dedup over the signatures."""

from __future__ import annotations

import random

import polars as pl

from pipeline_assets.lib.silver.dedup import (
    SIGNATURE_COLUMNS,
    index_entries,
    lsh_of,
    near_dedup,
    with_signatures,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.near_edges import (
    SIGNED_SCHEMA,
    NearPairs,
    band_edges,
    near_dedup_edges,
    pairs_in,
)

WORDS = [f"word{i}" for i in range(2000)]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(120))


def _edited(text: str, positions: list[int], rng: random.Random) -> str:
    words = text.split()
    for position in positions:
        words[position] = rng.choice(WORDS)
    return " ".join(words)


def _frame(texts: list[str], batch_id: str, prefix: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"{prefix}{i:03d}" for i in range(len(texts))],
            "batch_id": batch_id,
            "prompt": "Explain this.",
            "response": texts,
            "exact_hash": [f"{prefix}{i}" for i in range(len(texts))],
        }
    )


def _signed(frame: pl.DataFrame) -> pl.DataFrame:
    """A batch's signed frame as the pair tasks read it (SIGNED_SCHEMA)."""
    return frame.select(
        "record_id",
        "batch_id",
        signature=SIGNATURE_COLUMNS[0],
        response_signature=SIGNATURE_COLUMNS[1],
    ).cast(dict(SIGNED_SCHEMA))


def test_near_dedup_from_band_pairs_equals_near_dedup_over_the_signatures():
    """Within the batch: a near pair, and a chain whose ends are not near each other (its third
    record's survivor is no pair of it: its similarity is asked for). Against an earlier batch: a
    near copy of an entry with a signed response, and of one signed before responses were. A
    record removed before near dedup is named by pairs and left out."""
    rng = random.Random(11)
    earlier_texts = [_text(rng) for _ in range(6)]
    history = index_entries(_frame(earlier_texts, "b1", "e")).with_columns(
        response_signature=pl.when(pl.col("record_id") == "e004").then(
            pl.col("response_signature")
        )  # e004 alone was signed with its response
    )
    chain_rng = random.Random(14)  # estimated Jaccards: 0.87 to the second, 0.71 to the first
    chain = [_text(chain_rng)]
    chain.append(_edited(chain[0], [10, 60], chain_rng))  # two words apart
    chain.append(_edited(chain[1], [30, 90], chain_rng))  # two from the second, four from the first
    texts = [*(_text(rng) for _ in range(20)), *chain]
    texts[5] = _edited(texts[4], [50], rng)
    texts[7] = _edited(earlier_texts[4], [3], rng)
    texts[9] = _edited(earlier_texts[1], [70], rng)
    texts[12] = _edited(texts[11], [40], rng)  # 12 is removed before near dedup
    signed = with_signatures(_frame(texts, "b2", "r"))
    reached = signed.filter(pl.col("record_id") != "r012")

    kept, removed, details = near_dedup(reached, history.lazy())
    asked = []
    pairs = pairs_in(pl.concat([_signed(signed), history.select(SIGNED_SCHEMA.names())]), "b2")
    counted = NearPairs(pairs.edges, lambda p: asked.append(p.height) or pairs.similarity(p))
    from_pairs, removed_from_pairs, details_from_pairs = near_dedup_edges(
        reached.drop(SIGNATURE_COLUMNS), None, counted
    )

    assert removed["record_id"].to_list() == ["r005", "r007", "r009", "r021", "r022"]
    assert removed_from_pairs.equals(removed), removed_from_pairs
    assert from_pairs.equals(kept)
    assert details_from_pairs == details
    assert asked == [1], "r022's similarity to r020, its survivor, which it is no pair of"
    assert '"response_jaccard":null' in removed.filter(pl.col("record_id") == "r009")["evidence"][0]


def test_every_pair_is_verified_by_the_first_band_it_shares():
    """A near pair shares most of its bands' keys: the task of the first band they share verifies
    it, the others leave it out; an exact copy shares every band, and is paired once too."""
    rng = random.Random(12)
    text = _text(rng)
    signed = _signed(with_signatures(_frame([text, _edited(text, [7], rng), text], "b2", "r")))
    by_band = [band_edges(signed, band, "b2") for band in range(lsh_of(MinHashConfig()).bands)]
    pairs = pl.concat(by_band).select("record_id", "other_id")
    assert sorted(pairs.rows()) == [("r000", "r001"), ("r000", "r002"), ("r001", "r002")]
    assert ("r000", "r002") in by_band[0].select("record_id", "other_id").rows()
