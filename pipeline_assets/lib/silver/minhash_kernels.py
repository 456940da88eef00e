"""The two loops of MinHash signatures that numpy and polars cannot run fast, compiled by numba.

- ``sha1_hash32``: datasketch's shingle hash (the first 4 bytes of SHA-1, little-endian) of many
  byte spans of one buffer. SHA-1 runs on ``LANES`` messages side by side, each of its 80 rounds a
  loop over the lanes that the compiler turns into vector instructions. polars_hash's ``sha1``
  gives only a hex digest to parse back: 160 ns a shingle against 76 here (30-byte shingles).
- ``min_permuted``: for each text, the minimum over its shingles of ``a * h + b`` (mod 2^32) per
  permutation, in one pass over the hashes (numpy needs three passes a permutation: 78 ns a
  shingle at 128 permutations against 10 here).

Both release the GIL; compiled code is cached beside this module (numba's ``cache=True``), so a
process pays the compile (about 3 s) only once a machine.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import uint32, uint64

LANES = 16  # messages hashed side by side: one AVX-512 vector of uint32
_TAIL_MASK = np.array([0, 0xFF000000, 0xFFFF0000, 0xFFFFFF00], dtype=np.uint32)
_JIT = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(inline="always")
def _rotl(x, n):
    return uint32((x << uint32(n)) | (x >> uint32(32 - n)))


@numba.njit(**_JIT)
def big_endian_words(buffer: np.ndarray) -> np.ndarray:
    """The big-endian uint32 of ``buffer[i:i + 4]`` at every ``i`` (the buffer's last 3 bytes
    start none)."""
    words = np.empty(buffer.shape[0] - 3, dtype=np.uint32)
    for i in range(words.shape[0]):
        words[i] = (
            uint32(buffer[i]) << uint32(24)
            | uint32(buffer[i + 1]) << uint32(16)
            | uint32(buffer[i + 2]) << uint32(8)
            | uint32(buffer[i + 3])
        )
    return words


@numba.njit(**_JIT)
def sha1_hash32(words: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """datasketch's sha1_hash32 of each span ``start:end`` of the buffer whose
    ``big_endian_words`` are ``words``; the buffer needs 3 readable bytes past every end."""
    n = starts.shape[0]
    out = np.empty(n, dtype=np.uint32)
    w = np.zeros((80, LANES), dtype=np.uint32)
    state = np.zeros((5, LANES), dtype=np.uint32)
    working = np.zeros((5, LANES), dtype=np.uint32)
    a, b, c, d, e = working[0], working[1], working[2], working[3], working[4]
    blocks = np.zeros(LANES, dtype=np.int64)
    for first in range(0, n, LANES):
        used = min(LANES, n - first)
        most = 0
        for lane in range(LANES):
            state[0, lane], state[1, lane], state[2, lane] = 0x67452301, 0xEFCDAB89, 0x98BADCFE
            state[3, lane], state[4, lane] = 0x10325476, 0xC3D2E1F0
            length = ends[first + lane] - starts[first + lane] if lane < used else -9
            blocks[lane] = (length + 8) // 64 + 1  # the message, 0x80 and its 8-byte bit length
            most = max(most, blocks[lane])
        for block in range(most):
            for lane in range(used):
                if block < blocks[lane]:
                    _load_block(
                        words,
                        starts[first + lane],
                        ends[first + lane],
                        block,
                        blocks[lane],
                        w,
                        lane,
                    )
            for t in range(16, 80):
                for lane in range(LANES):
                    w[t, lane] = _rotl(
                        w[t - 3, lane] ^ w[t - 8, lane] ^ w[t - 14, lane] ^ w[t - 16, lane], 1
                    )
            working[:] = state
            for t in range(80):
                if t < 20:
                    for lane in range(LANES):
                        f = (b[lane] & c[lane]) | (~b[lane] & d[lane])
                        _round(a, b, c, d, e, lane, f, 0x5A827999, w[t, lane])
                elif t < 40 or t >= 60:
                    k = 0x6ED9EBA1 if t < 40 else 0xCA62C1D6
                    for lane in range(LANES):
                        _round(a, b, c, d, e, lane, b[lane] ^ c[lane] ^ d[lane], k, w[t, lane])
                else:
                    for lane in range(LANES):
                        f = (b[lane] & c[lane]) | (b[lane] & d[lane]) | (c[lane] & d[lane])
                        _round(a, b, c, d, e, lane, f, 0x8F1BBCDC, w[t, lane])
            for lane in range(LANES):
                if block < blocks[lane]:
                    state[0, lane] += a[lane]
                    state[1, lane] += b[lane]
                    state[2, lane] += c[lane]
                    state[3, lane] += d[lane]
                    state[4, lane] += e[lane]
        for lane in range(used):
            h = state[0, lane]  # the digest's first 4 bytes, big-endian: read them little-endian
            out[first + lane] = uint32(
                (h >> uint32(24))
                | (h >> uint32(8) & uint32(0xFF00))
                | (h << uint32(8) & uint32(0xFF0000))
                | (h << uint32(24))
            )
    return out


@numba.njit(inline="always")
def _round(a, b, c, d, e, lane, f, k, word):
    temp = uint32(_rotl(a[lane], 5) + uint32(f) + e[lane] + uint32(k) + word)
    e[lane], d[lane], c[lane], b[lane], a[lane] = (
        d[lane],
        c[lane],
        _rotl(b[lane], 30),
        a[lane],
        temp,
    )


@numba.njit(inline="always")
def _load_block(words, start, end, block, blocks, w, lane):
    """Block ``block`` of the padded message ``start:end`` into lane ``lane``'s first 16 words."""
    length = end - start
    for t in range(16):
        at = block * 64 + 4 * t
        left = length - at
        if left >= 4:
            w[t, lane] = words[start + at]
        elif left > 0:
            w[t, lane] = (words[start + at] & _TAIL_MASK[left]) | uint32(0x80) << uint32(
                24 - 8 * left
            )
        elif left == 0:
            w[t, lane] = uint32(0x80000000)
        else:
            w[t, lane] = 0
    if block == blocks - 1:
        bits = uint64(length) * uint64(8)
        w[14, lane] = uint32(bits >> uint64(32))
        w[15, lane] = uint32(bits & uint64(0xFFFFFFFF))


@numba.njit(**_JIT)
def min_permuted(
    hashes: np.ndarray,
    bounds: np.ndarray,
    first: int,
    last: int,
    a: np.ndarray,
    b: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out[i, j]`` = the minimum over text i's hashes h of ``a[j] * h + b[j]`` (mod 2^32), for
    texts ``first`` to ``last`` (text i's hashes are ``hashes[bounds[i]:bounds[i + 1]]``)."""
    for text in range(first, last):
        row = out[text]
        row[:] = 0xFFFFFFFF
        for i in range(bounds[text], bounds[text + 1]):
            h = uint64(hashes[i])
            for j in range(a.shape[0]):
                value = uint32((uint64(a[j]) * h + uint64(b[j])) & uint64(0xFFFFFFFF))
                if value < row[j]:
                    row[j] = value
