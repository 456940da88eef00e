"""MinHash signatures for many documents at once, identical to datasketch's.

datasketch (2.x, scheme ``affine32``) hashes each shingle with the first 4 bytes of SHA-1
(little-endian), mixes it with the MurmurHash3 32-bit finalizer and applies ``a * h + b`` modulo
2^32 per permutation, keeping the minimum. Here the same arithmetic runs over a whole chunk of
documents in numpy, with the permutation parameters taken from datasketch itself, so stored
signatures load into ``datasketch.MinHash(hashvalues=..., scheme="affine32")`` and its LSH.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial

import numpy as np
import polars as pl
import polars_hash as plh

_HASH_CHUNK_DOCS = 20_000  # shingled and hashed at once in polars
_PERMUTE_CHUNK_DOCS = 4096  # a block's shingle hashes (~1 MB) stay in cache across permutations


@dataclass(frozen=True)
class MinHashConfig:
    num_perm: int = 128
    seed: int = 1
    shingle_words: int = 5
    threshold: float = 0.8
    lowercase: bool = True
    # LSH bands are chosen to minimize w * P(false candidate) + (1 - w) * P(missed pair). Candidates
    # are verified against the threshold, so a false candidate costs a comparison and a missed pair
    # costs a duplicate: weigh misses far more (16 bands of 8 rows at 128 permutations).
    lsh_false_positive_weight: float = 0.05


def shingles(text: str, config: MinHashConfig = MinHashConfig()) -> set[bytes]:
    """Word n-grams (UTF-8, words joined by one space); a text shorter than n is one shingle.

    The reference definition: ``shingle_hashes`` computes the same shingles in polars and hashes
    them as datasketch's sha1_hash32 does.
    """
    words = (text.lower() if config.lowercase else text).split()
    n = config.shingle_words
    if len(words) <= n:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


@lru_cache(maxsize=8)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from datasketch import MinHash  # imported here: it pulls in scipy, which every command would otherwise load

    a, b = MinHash(num_perm=num_perm, seed=seed).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _fmix32(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (wrapping uint32 arithmetic)."""
    values = values ^ (values >> np.uint32(16))
    values = values * np.uint32(0x85EBCA6B)
    values = values ^ (values >> np.uint32(13))
    values = values * np.uint32(0xC2B2AE35)
    return values ^ (values >> np.uint32(16))


def shingle_hashes(texts: Sequence[str], config: MinHashConfig = MinHashConfig()) -> tuple[np.ndarray, np.ndarray]:
    """The sha1_hash32 of every shingle of every text, and where each text's hashes start."""
    words = pl.col("text").str.to_lowercase() if config.lowercase else pl.col("text")
    docs = pl.DataFrame({"text": texts}, schema={"text": pl.String}).with_row_index("doc").select(
        "doc", words=words.str.extract_all(r"\S+")
    )
    n = config.shingle_words
    short = docs.filter(pl.col("words").list.len() <= n).select("doc", shingle=pl.col("words").list.join(" "))
    long = docs.filter(pl.col("words").list.len() > n)
    grams = (
        long.with_columns(position=pl.int_ranges(0, pl.col("words").list.len()), last_start=pl.col("words").list.len() - n)
        .explode("words", "position")
        .select(
            "doc",
            "position",
            "last_start",
            shingle=pl.concat_str([pl.col("words").shift(-k) for k in range(n)], separator=" "),
        )
        .filter(pl.col("position") <= pl.col("last_start"))
    )
    hashed = (
        pl.concat([short, grams.select("doc", "shingle")])
        .sort("doc", maintain_order=True)
        .select("doc", first4=plh.col("shingle").nchash.sha1().str.slice(0, 8).str.to_integer(base=16, dtype=pl.UInt32))
    )
    doc_ids = hashed["doc"].to_numpy()
    # sha1_hash32 reads the first 4 digest bytes little-endian; the hex digits read them big-endian
    return hashed["first4"].to_numpy().byteswap(), np.searchsorted(doc_ids, np.arange(len(texts)))


def signatures(texts: Sequence[str], config: MinHashConfig = MinHashConfig()) -> np.ndarray:
    """One row of ``num_perm`` uint32 per text."""
    out = np.empty((len(texts), config.num_perm), dtype=np.uint32)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # numpy releases the GIL
        for start in range(0, len(texts), _HASH_CHUNK_DOCS):
            chunk = texts[start : start + _HASH_CHUNK_DOCS]
            hashes, offsets = shingle_hashes(chunk, config)
            bounds = np.append(offsets, len(hashes))
            permute = partial(_permute_block, _fmix32(hashes), bounds, out=out[start:], config=config)
            list(pool.map(permute, range(0, len(chunk), _PERMUTE_CHUNK_DOCS)))
    return out


def _permute_block(mixed: np.ndarray, bounds: np.ndarray, first: int, out: np.ndarray, config: MinHashConfig) -> None:
    """Minimum over each text's shingles of a * h + b (mod 2^32), for one block of texts.

    One permutation at a time over the block's hashes: a vector that stays in cache, where a
    (shingles x permutations) matrix would stream through memory several times.
    """
    a, b = permutations(config.num_perm, config.seed)
    last = min(first + _PERMUTE_CHUNK_DOCS, len(bounds) - 1)
    block = mixed[bounds[first] : bounds[last]]
    starts = bounds[first:last] - bounds[first]
    permuted = np.empty_like(block)
    for j in range(config.num_perm):
        np.multiply(block, a[j], out=permuted)  # wraps modulo 2^32, as datasketch's does
        permuted += b[j]
        out[first:last, j] = np.minimum.reduceat(permuted, starts)


def jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of paired signature rows (the share of equal hash values)."""
    return (left == right).mean(axis=-1)
