"""MinHash signatures identical to datasketch's; exact and near dedup within a batch and
across batches."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import polars as pl
import pytest
from datasketch import MinHash
from datasketch.lsh import _optimal_param

from pipeline_assets.lib.silver.dedup import (
    SIGNATURE_COLUMNS,
    BandMatches,
    cluster_survivors,
    exact_dedup,
    exact_hashes,
    index_entries,
    lsh_params,
    near_dedup,
    node_order,
    search_band,
    with_signatures,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig, shingle_hashes, shingles, signatures
from pipeline_assets.lib.silver.minhash_kernels import big_endian_words, sha1_hash32
from pipeline_assets.lib.silver.near_edges import near_dedup_edges, pairs_in

WORDS = [f"word{i}" for i in range(2000)] + ["Straße", "café", "naïve", "ÉCOLE", "東京", "x"]
SEPARATORS = [" "] * 20 + ["  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u2003", "\u3000"]


def _texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 150))) for _ in range(n)]


def _long_text(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of words, mostly one space apart, sometimes other whitespace."""
    words = [rng.choice(WORDS) for _ in range(chars // 8)]
    separators = rng.choices(SEPARATORS, k=len(words))
    return "".join(word + separator for word, separator in zip(words, separators, strict=True))


def _datasketch_signature(text: str) -> np.ndarray:
    reference = MinHash(num_perm=128, seed=1)
    reference.update_batch(list(shingles(text)))
    return reference.hashvalues


def _batch(texts: list[str], batch_id: str = "b1", prefix: str = "r") -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"{prefix}{i:05d}" for i in range(len(texts))],
            "batch_id": batch_id,
            "prompt": "Explain this.",
            "response": texts,
            "exact_hash": "h",  # near dedup runs after exact dedup, which adds it
        }
    )


def _edited(text: str, rng: random.Random, edits: int = 1) -> str:  # 120 words: Jaccard ~0.92
    words = text.split()
    for _ in range(edits):
        words[rng.randrange(len(words))] = rng.choice(WORDS)
    return " ".join(words)


def test_signatures_equal_datasketch_per_document_and_bulk():
    texts = _texts(400) + ["", "one", "a b c d e", "Tab\tand\nnewline  spaces"]
    ours = signatures(texts)
    for text, row in zip(texts, ours, strict=True):
        reference = MinHash(num_perm=128, seed=1)
        reference.update_batch(list(shingles(text)))
        assert np.array_equal(row, reference.hashvalues), text[:40]
    bulk = MinHash.bulk([list(shingles(t)) for t in texts], num_perm=128, seed=1)
    assert np.array_equal(ours, np.array([m.hashvalues for m in bulk]))


def test_signatures_follow_num_perm_and_seed_and_load_into_datasketch():
    texts = _texts(20)
    config = MinHashConfig(num_perm=64, seed=42)
    ours = signatures(texts, config)
    assert ours.shape == (20, 64)
    assert not np.array_equal(ours[:, :64], signatures(texts)[:, :64])
    loaded = [MinHash(hashvalues=row, seed=42, scheme="affine32") for row in ours[:2]]
    reference = [MinHash(num_perm=64, seed=42) for _ in range(2)]
    for minhash, text in zip(reference, texts[:2], strict=True):
        minhash.update_batch(list(shingles(text)))
    assert loaded[0].jaccard(loaded[1]) == reference[0].jaccard(reference[1])


def test_signatures_equal_datasketch_on_long_documents_in_chunks_blocks_and_threads(monkeypatch):
    rng = random.Random(11)
    texts = [_long_text(rng, chars) for chars in (2_000, 7_000, 20_000)] + _texts(30)
    expected = np.array([_datasketch_signature(text) for text in texts])
    assert np.array_equal(signatures(texts, threads=1), expected)
    monkeypatch.setattr(
        "pipeline_assets.lib.silver.minhash._CHUNK_CHARS", 3_000
    )  # several chunks of several blocks
    monkeypatch.setattr("pipeline_assets.lib.silver.minhash._BLOCK_HASHES", 400)
    assert np.array_equal(signatures(texts, threads=1), expected)
    assert np.array_equal(signatures(texts, threads=2), expected)


def test_words_split_at_the_whitespace_polars_matches_with_backslash_s():
    code_points = [
        c for c in range(0x10000) if not 0xD800 <= c < 0xE000
    ]  # White_Space has none above
    texts = [f"x{chr(c)}y" for c in code_points]
    split_by_polars = pl.Series(texts).str.extract_all(r"\S+").list.len().to_numpy() == 2
    hashes, bounds = shingle_hashes(texts)
    assert np.array_equal(np.diff(bounds), np.ones(len(texts)))
    assert np.array_equal(hashes == shingle_hashes(["x y"])[0][0], split_by_polars)
    assert split_by_polars.sum() == 25  # \t \n \v \f \r, space and 19 beyond ASCII


def test_lsh_params_match_datasketch_at_equal_weights():
    for threshold, num_perm in [(0.8, 128), (0.5, 128), (0.9, 256)]:
        assert tuple(vars(lsh_params(threshold, num_perm, 0.5)).values()) == _optimal_param(
            threshold, num_perm, 0.5, 0.5
        )


def test_exact_dedup_keeps_smallest_record_id_and_earlier_batches_win():
    batch = (
        _batch(["alpha beta", "gamma", "alpha beta", "alpha beta"])
        .drop("exact_hash")
        .sample(fraction=1.0, shuffle=True, seed=3)
    )
    kept, rejected, _ = exact_dedup(batch, None)
    assert sorted(kept["record_id"]) == ["r00000", "r00001"]
    assert rejected.sort("record_id")["duplicate_of"].to_list() == ["r00000", "r00000"]

    history = kept.select("record_id", "batch_id", "exact_hash").lazy()
    kept, rejected, details = exact_dedup(
        _batch(["gamma", "delta"], batch_id="b2", prefix="s").drop("exact_hash"), history
    )
    assert kept["record_id"].to_list() == ["s00001"]
    row = rejected.row(0, named=True)
    assert row["duplicate_of"] == "r00001" and '"duplicate_of_batch":"b1"' in row["evidence"]
    assert details == {"against_other_batches": 1}


def test_near_dedup_within_a_batch_is_deterministic():
    rng = random.Random(1)
    originals = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(50)]
    copies = [_edited(text, rng) for text in originals[:10]]
    batch = _batch(originals + copies)
    kept, rejected, _ = near_dedup(batch, None)
    assert sorted(rejected["record_id"]) == [f"r{i:05d}" for i in range(50, 60)]
    assert rejected.sort("record_id")["duplicate_of"].to_list() == [f"r{i:05d}" for i in range(10)]
    assert (rejected["jaccard"] >= 0.8).all()
    assert kept.filter(pl.col("record_id") == "r00003")["cluster_id"].item() == "r00003"
    index = index_entries(batch)
    assert index.height == 60 and index["lsh_params"].unique().to_list() == [
        "perm128-seed1-shingle5-b16-r8"
    ]

    _, shuffled, _ = near_dedup(batch.sample(fraction=1.0, shuffle=True, seed=9), None)
    assert sorted(shuffled["record_id"]) == sorted(rejected["record_id"])


def test_near_dedup_against_earlier_batches_uses_only_their_hashes():
    rng = random.Random(2)
    originals = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(30)]
    _, first_rejected, _ = near_dedup(_batch(originals), None)
    assert first_rejected.is_empty()
    index = index_entries(_batch(originals))
    later_texts = [_edited(originals[4], rng), " ".join(rng.choice(WORDS) for _ in range(120))]
    kept, rejected, details = near_dedup(
        _batch(later_texts, batch_id="b2", prefix="s"), index.lazy()
    )
    assert rejected.select("record_id", "duplicate_of").rows() == [("s00000", "r00004")]
    assert details["against_other_batches"] == 1
    assert kept["record_id"].to_list() == ["s00001"]


def test_a_record_kept_in_another_batch_wins_even_when_that_batch_is_later():
    """A batch re-run after a later one (it was blocked) yields to the copies the later one kept."""
    rng = random.Random(4)
    texts = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    later_kept = _batch(texts[:2], batch_id="b3", prefix="t").drop("exact_hash")
    exact_kept, _, _ = exact_dedup(later_kept, None)
    history = index_entries(exact_kept).lazy()
    rerun = _batch([texts[0], _edited(texts[1], rng), texts[2]], batch_id="b2", prefix="s").drop(
        "exact_hash"
    )
    exact_kept, exact_rejected, exact_details = exact_dedup(rerun, history)
    assert exact_rejected.select("record_id", "duplicate_of").rows() == [("s00000", "t00000")]
    assert exact_details["against_other_batches"] == 1
    near_kept, near_rejected, near_details = near_dedup(exact_kept, history)
    assert near_rejected.select("record_id", "duplicate_of").rows() == [("s00001", "t00001")]
    assert near_details["against_other_batches"] == 1
    assert near_kept["record_id"].to_list() == ["s00002"]


def test_index_built_with_other_settings_is_refused():
    index = index_entries(_batch(_texts(5)))
    config = MinHashConfig(threshold=0.5)
    with pytest.raises(ValueError, match="MinHash settings changed"):
        near_dedup(_batch(_texts(5), batch_id="b2"), index.lazy(), config)


def test_different_answers_to_one_long_shared_prompt_all_survive():
    rng = random.Random(5)
    prompt = " ".join(rng.choice(WORDS) for _ in range(2000))
    answers = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(50)]
    batch = _batch(answers).with_columns(prompt=pl.lit(prompt))
    kept, rejected, details = near_dedup(batch, None)
    assert rejected.is_empty() and kept.height == 50
    assert details["candidate_pairs_verified"] == 0

    _, later_rejected, _ = near_dedup(
        _batch([answers[3], answers[0][::-1]], batch_id="b2", prefix="s").with_columns(
            prompt=pl.lit(prompt)
        ),
        index_entries(batch).lazy(),
    )
    assert later_rejected.select("record_id", "duplicate_of").rows() == [("s00000", "r00003")]
    assert '"response_jaccard":1.0' in later_rejected["evidence"].item()


def test_an_index_written_before_responses_were_signed_still_dedups():
    """Entries without response_signature (older silver/minhash_index rows) are judged on prompt
    + response."""
    rng = random.Random(6)
    originals = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(5)]
    legacy = index_entries(_batch(originals)).drop("response_signature")
    _, rejected, _ = near_dedup(
        _batch([_edited(originals[1], rng)], batch_id="b2", prefix="s"), legacy.lazy()
    )
    assert rejected.select("record_id", "duplicate_of").rows() == [("s00000", "r00001")]
    assert '"response_jaccard":null' in rejected["evidence"].item()


def test_clusters_are_connected_components_led_by_their_smallest_order_key():
    # 0-1-2 is a chain (0 and 2 never matched directly), 3-4 a pair, 5 alone
    yields = np.array([1, 0, 1, 1, 1, 1], dtype=np.int8)
    batches = pl.Series(["b2", "b1", "b2", "b3", "b2", "b1"])
    ids = pl.Series(["r0", "r9", "r2", "r3", "r4", "r5"])
    order = node_order(yields, batches, ids)
    assert order.tolist() == [1, 5, 0, 2, 4, 3], "by yields, then batch, then record id"

    survivors = cluster_survivors(np.array([0, 2, 3]), np.array([1, 1, 4]), order)
    assert survivors.tolist() == [1, 1, 1, 4, 4, 5]
    nothing = np.empty(0, dtype=np.int64)
    assert cluster_survivors(nothing, nothing, order[order < 3]).tolist() == [0, 1, 2]


def test_the_sha1_kernel_equals_hashlib_at_every_length_across_block_boundaries():
    rng = np.random.default_rng(5)
    buffer = rng.integers(0, 256, size=20_000, dtype=np.uint8)
    lengths = np.concatenate([np.arange(0, 200), rng.integers(0, 400, size=300)])
    starts = rng.integers(0, len(buffer) - 400, size=len(lengths))
    ends = starts + lengths
    padded = np.concatenate([buffer, np.zeros(3, dtype=np.uint8)])

    ours = sha1_hash32(big_endian_words(padded), starts, ends)

    expected = [
        int.from_bytes(hashlib.sha1(buffer[s:e].tobytes()).digest()[:4], "little")
        for s, e in zip(starts, ends, strict=True)
    ]
    assert ours.tolist() == expected


def test_a_band_search_names_the_records_sharing_a_key_and_leaves_exact_copies_to_exact_dedup():
    """r01 and r02 are exact copies (one hash, one key); r03 shares their key: r01, the copy exact
    dedup keeps, and r03 are candidates, r02 is not. r07 and r08 share a key only with each other,
    as exact copies: neither is. r05 holds a key an entry of another batch holds."""
    keys = pl.DataFrame(
        {
            "record_id": ["r02", "r01", "r03", "r05", "r07", "r08"],
            "exact_hash": ["h1", "h1", "h3", "h5", "h7", "h7"],
            "band_key": [10, 10, 10, 30, 90, 90],
        }
    )
    within = search_band(keys, 0, within=True)
    assert sorted(within.candidates) == ["r01", "r03"] and within.keys == 0
    bands = pl.DataFrame(
        {
            "band": pl.Series([0, 1, 0], dtype=pl.Int16),
            "band_key": [30, 10, 77],
            "record_id": ["x1", "x2", "x3"],
            "batch_id": ["b0", "b0", "b0"],
        }
    ).lazy()
    held = search_band(keys, 0, within=False, bands=bands)
    assert held.candidates.to_list() == ["r05"]  # band 1's key 10 is another band's
    assert held.entries.rows() == [("x1", "b0")] and held.keys == 3  # 10, 30 and 90
    both = BandMatches.joined([within, held])
    assert both.candidates.to_list() == ["r01", "r03", "r05"] and both.keys == 3
    none_held = bands.filter(pl.col("band_key") != 30)
    assert search_band(keys, 0, within=False, bands=none_held).candidates.is_empty()


def test_dedup_judges_only_the_records_that_share_a_hash_or_a_key_and_keeps_the_batch_order():
    """Most of a batch shares nothing: exact dedup judges only the records sharing a hash (with
    another or an earlier batch's entry), near dedup only the band searches' candidates. What they
    keep is the batch, in its order, less what they removed, as when every record is judged."""
    rng = random.Random(7)
    originals = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(40)]
    texts = originals + originals[:5] + [_edited(text, rng) for text in originals[5:10]]
    batch = (
        _batch(texts).drop("exact_hash").sample(fraction=1.0, shuffle=True, seed=5).with_row_index()
    )
    earlier = _batch([originals[20]], batch_id="b0", prefix="e")
    history = exact_dedup(earlier.drop("exact_hash"), None)[0].select(
        "record_id", "batch_id", "exact_hash"
    )
    kept, removed, details = exact_dedup(batch, history.lazy())
    removed_ids = set(removed["record_id"])
    assert len(removed_ids) == 6 and details == {"against_other_batches": 1}
    assert kept["index"].to_list() == [
        i for i, record in zip(batch["index"], batch["record_id"]) if record not in removed_ids
    ], "the batch's order, less the removed"
    by_hash = {}
    for record, hashed in sorted(zip(batch["record_id"], batch.pipe(exact_hashes))):
        by_hash.setdefault(hashed, record)
    assert set(kept["record_id"]) == set(by_hash.values()) - {"r00020"}, (
        "the smallest record id of each hash, less the one an earlier batch kept"
    )

    signed = with_signatures(kept)
    whole, whole_removed, _ = near_dedup(signed, None)
    near_copies = {f"r{i:05d}" for i in range(45, 50)} | {f"r{i:05d}" for i in range(5, 10)}
    candidates = signed.filter(pl.col("record_id").is_in(near_copies)).select(
        "record_id",
        "batch_id",
        signature=SIGNATURE_COLUMNS[0],
        response_signature=SIGNATURE_COLUMNS[1],
    )
    only, only_removed, _ = near_dedup_edges(kept, None, pairs_in(candidates, "b1"))
    assert only.equals(whole.select(only.columns)) and only["index"].is_sorted()
    assert only_removed.sort("record_id").equals(
        whole_removed.sort("record_id").select(only_removed.columns)
    )
    assert sorted(only_removed["record_id"]) == [f"r{i:05d}" for i in range(45, 50)]
