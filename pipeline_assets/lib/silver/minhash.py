"""MinHash signatures for many documents at once, identical to datasketch's.

datasketch (2.x, scheme ``affine32``) hashes each shingle with the first 4 bytes of SHA-1
(little-endian), mixes it with the MurmurHash3 32-bit finalizer and applies ``a * h + b`` modulo
2^32 per permutation, keeping the minimum. Here the same arithmetic runs over a whole chunk of
documents, with the permutation parameters taken from datasketch itself, so stored signatures load
into ``datasketch.MinHash(hashvalues=..., scheme="affine32")`` and its LSH.

A chunk's words are found in numpy and joined into one buffer; each shingle is a span of it. The
spans' SHA-1 and the permutations' minimum are numba loops (``lib.silver.minhash_kernels``): on long
documents they were over 80% of the time as polars and numpy calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import polars as pl
import pyarrow as pa

_CHUNK_CHARS = (
    1 << 20
)  # texts of about 1M characters shingled and hashed at once: their arrays stay in cache
_BLOCK_HASHES = 1 << 18  # whole texts with about this many hashes permuted together (1 MB)
# Unicode White_Space beyond ASCII: with \t \n \v \f \r and space, what \s matches in polars and
# Python
_NON_ASCII_SPACE = (
    0x85,
    0xA0,
    0x1680,
    *range(0x2000, 0x200B),
    0x2028,
    0x2029,
    0x202F,
    0x205F,
    0x3000,
)


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

    The reference definition, but for one detail: ``shingle_hashes`` splits words at Unicode
    White_Space (polars' ``\\s``), where str.split also splits at the separators \\x1c to \\x1f.
    """
    words = (text.lower() if config.lowercase else text).split()
    n = config.shingle_words
    if len(words) <= n:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


@lru_cache(maxsize=8)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from datasketch import (
        MinHash,  # imported here: it pulls in scipy, which every command would otherwise load
    )

    a, b = MinHash(num_perm=num_perm, seed=seed).permutations
    return a.astype(np.uint32), b.astype(np.uint32)


def _fmix32(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (wrapping uint32 arithmetic)."""
    values = values ^ (values >> np.uint32(16))
    values = values * np.uint32(0x85EBCA6B)
    values = values ^ (values >> np.uint32(13))
    values = values * np.uint32(0xC2B2AE35)
    return values ^ (values >> np.uint32(16))


def signatures(
    texts: Sequence[str], config: MinHashConfig = MinHashConfig(), threads: int | None = None
) -> np.ndarray:
    """One row of ``num_perm`` uint32 per text, on ``threads`` threads (default: polars' pool size,
    so POLARS_MAX_THREADS=1 means one thread throughout).

    With more than one, the pool permutes a chunk's hashes while this thread hashes the next chunk
    (the kernels release the GIL).
    """
    min_permuted = _kernels().min_permuted
    threads = threads or pl.thread_pool_size()
    a, b = permutations(config.num_perm, config.seed)
    out = np.empty((len(texts), config.num_perm), dtype=np.uint32)
    with ThreadPoolExecutor(max_workers=threads) if threads > 1 else nullcontext() as pool:
        pending = []
        for first, last in _chunks(texts):
            hashes, bounds = shingle_hashes(texts[first:last], config)
            mixed = _fmix32(hashes)
            blocks = _blocks(bounds, threads)
            for start, stop in zip(blocks[:-1], blocks[1:], strict=True):
                block = (mixed, bounds, start, stop, a, b, out[first:last])
                if pool:
                    pending.append(pool.submit(min_permuted, *block))
                else:
                    min_permuted(*block)
        for done in pending:
            done.result()
    return out


def _chunks(texts: Sequence[str]) -> list[tuple[int, int]]:
    """Ranges of whole texts of about _CHUNK_CHARS characters each."""
    ends = np.cumsum([len(text) for text in texts])
    limits = np.arange(_CHUNK_CHARS, ends[-1] if len(ends) else 0, _CHUNK_CHARS)
    cuts = np.searchsorted(ends, limits, side="right")
    edges = np.unique([0, *cuts, len(texts)]).tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def _blocks(bounds: np.ndarray, threads: int) -> np.ndarray:
    """Text indices that cut the texts into blocks of at most _BLOCK_HASHES hashes, at least one
    per thread (a text with more hashes is a block of its own)."""
    size = max(1, min(_BLOCK_HASHES, -(-int(bounds[-1]) // threads)))
    cuts = np.searchsorted(bounds, np.arange(0, bounds[-1], size))
    return np.unique(np.concatenate([[0], cuts, [len(bounds) - 1]]))


def shingle_hashes(
    texts: Sequence[str], config: MinHashConfig = MinHashConfig()
) -> tuple[np.ndarray, np.ndarray]:
    """The sha1_hash32 of every shingle of every text, and the bounds of each text's hashes
    (text i's are ``hashes[bounds[i]:bounds[i + 1]]``).

    The texts' bytes are split into words in numpy and rejoined with single spaces; every shingle
    is a span of that buffer, hashed where it lies.
    """
    buffer, text_starts = _text_bytes(texts, config.lowercase)
    is_space, word_starts, word_ends = _words(buffer)
    word_counts = np.diff(np.searchsorted(word_starts, text_starts))
    joined, word_starts, word_ends = _joined(buffer, is_space, word_starts, word_ends, word_counts)
    shingle_starts, shingle_ends, bounds = _shingle_spans(
        word_starts, word_ends, word_counts, config.shingle_words
    )
    kernels = _kernels()
    return kernels.sha1_hash32(
        kernels.big_endian_words(joined), shingle_starts, shingle_ends
    ), bounds


def _kernels():
    """lib.silver.minhash_kernels, imported on first use: numba takes 0.15 s to import, which every
    process that loads the code location would pay otherwise."""
    from pipeline_assets.lib.silver import minhash_kernels

    return minhash_kernels


def _text_bytes(texts: Sequence[str], lowercase: bool) -> tuple[np.ndarray, np.ndarray]:
    """The texts' UTF-8 bytes end to end, each followed by a space (no word spans two texts), and
    where each text starts (one more: the end)."""
    text = pl.Series(texts, dtype=pl.String)
    text = (text.str.to_lowercase() if lowercase else text) + " "
    array = text.cast(pl.Binary).to_arrow().cast(pa.large_binary())
    _, offsets, data = array.buffers()
    starts = np.frombuffer(offsets, dtype=np.int64)[array.offset : array.offset + len(array) + 1]
    return np.frombuffer(data, dtype=np.uint8, count=starts[-1]), starts


def _words(buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which bytes are whitespace, and where each word (a run of other bytes) starts and ends."""
    spaces = np.empty(len(buffer) + 1, dtype=bool)
    spaces[0] = True  # a word may start at the first byte
    is_space = spaces[1:]
    np.equal(buffer, ord(" "), out=is_space)
    is_space |= buffer - np.uint8(9) <= 4  # \t \n \v \f \r: 9 to 13 (smaller bytes wrap to large)
    is_space[_non_ascii_spaces(buffer)] = True
    edges = np.flatnonzero(
        spaces[1:] != spaces[:-1]
    )  # the buffer ends with a space: every word has an end
    return is_space, edges[0::2], edges[1::2]


@lru_cache(maxsize=1)
def _non_ascii_space_codes() -> dict[int, np.ndarray]:
    """Per UTF-8 length, the non-ASCII whitespace characters' bytes as big-endian integers."""
    encoded = [chr(c).encode() for c in _NON_ASCII_SPACE]
    return {n: np.array([int.from_bytes(e, "big") for e in encoded if len(e) == n]) for n in (2, 3)}


def _non_ascii_spaces(buffer: np.ndarray) -> np.ndarray:
    """Positions of every byte of every non-ASCII whitespace character (2 or 3 bytes in UTF-8)."""
    leads = np.flatnonzero(buffer >= 0xC2)  # only multi-byte characters start with these
    leads = leads[buffer[leads] <= 0xE3]
    last = len(buffer) - 1
    first, second, third = (buffer[np.minimum(leads + k, last)].astype(np.int64) for k in range(3))
    codes = _non_ascii_space_codes()
    two = leads[np.isin(first << 8 | second, codes[2])]
    three = leads[np.isin(first << 16 | second << 8 | third, codes[3])]
    return np.concatenate([two, two + 1, three, three + 1, three + 2])


def _joined(
    buffer: np.ndarray,
    is_space: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    counts: np.ndarray,
):
    """The words of each text joined by one space, text after text (16 zero bytes after them, so
    a shingle's last 4-byte word can be read whole); and each word's start and end there."""
    last_words = (np.cumsum(counts) - 1)[counts > 0]
    keep = ~is_space
    keep[ends] = True  # the first byte after each word: its separator, but after a text's last word
    keep[ends[last_words]] = False
    kept = pl.Series(buffer).filter(pl.Series(keep)).to_numpy()  # 3 to 4 times np.compress's speed
    lengths = ends - starts
    step = lengths + 1
    step[last_words] -= 1
    new_starts = np.zeros(len(starts), dtype=np.int64)
    np.cumsum(step[:-1], out=new_starts[1:])
    new_ends = new_starts + lengths
    joined = np.concatenate([kept, np.zeros(16, dtype=np.uint8)])
    joined[new_ends[step > lengths]] = ord(" ")  # the separators, whichever whitespace they were
    return joined, new_starts, new_ends


def _shingle_spans(starts: np.ndarray, ends: np.ndarray, counts: np.ndarray, n: int):
    """Each shingle's start and end in the joined words, and the bounds of each text's shingles.

    A text of w > n words has w - n + 1 shingles (words k to k + n - 1); one of 1 to n words is one
    shingle of all of them; one without words is one empty shingle.
    """
    per_text = np.maximum(counts - n + 1, 1)
    bounds = np.concatenate([[0], np.cumsum(per_text)])
    first_words = np.cumsum(counts) - counts
    first = np.arange(bounds[-1]) + np.repeat(first_words - bounds[:-1], per_text)
    last = np.minimum(first + n - 1, np.repeat(first_words + counts - 1, per_text))
    empty = np.repeat(counts == 0, per_text)
    if not empty.any():
        return starts[first], ends[last], bounds
    padded_starts, padded_ends = (
        np.append(starts, 0),
        np.append(ends, 0),
    )  # an empty text reads index -1: 0 to 0
    first[empty], last[empty] = -1, -1
    return padded_starts[first], padded_ends[last], bounds


def jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of paired signature rows (the share of equal hash values)."""
    return (left == right).mean(axis=-1)
