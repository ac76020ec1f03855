"""Checksums: of a tensor's bf16 bit pattern (what the reader must end up with), of a delta's
change, and of a chunk.

Three checks, each sized to what it guards:

- ``change_sum`` (every delta, O(changed values) on both sides): a 64-bit sum over the changed
  elements i of h(i, new_i) - h(i, old_i) mod 2^64, with h(i, v) = (2i + 1) * T[v] and T a fixed
  table of 65536 pseudo-random 64-bit values. The publisher sums over its baseline; the reader
  over what its target held before and holds after. It therefore catches a wrong decode (value or
  position) and a target that was not at the base version wherever the delta touches it (an
  overwrite from a different old value, or an ulp step from one, changes the sum). Position-aware
  (the odd factor 2i + 1) and nonlinear in the value (the table), so errors do not cancel except
  by a 2^-64 accident; it guards against accidents, not adversaries.
- ``bits_checksum`` (SHA-256): fulls check every tensor whole. Deltas check a rotating window of
  the model (see `WeightPublisher(check_versions=...)`), which catches drift where no delta
  touches, within a bounded number of versions, at a fixed small cost per version.
- ``chunk_crc`` (CRC32): catches a torn or corrupted Redis value before anything is decoded.

SHA-256 runs over the little-endian bf16 bytes, so fp32 and bf16 copies of the same values agree.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from zlib_ng import zlib_ng

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
# Changes per block in `change_sum`: its uint64 buffers of this size stay in L2.
_SUM_BLOCK = 1 << 16


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(_U64) + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


# Plain integer arithmetic, so the same on every machine and numpy version.
_VALUE_HASH = _splitmix64(np.arange(1 << 16, dtype=_U64) + _U64(0x5EED_0000))
_VALUE_HASH.setflags(write=False)


def change_sum(positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """sum_i (2 p_i + 1) * (T[new_i] - T[old_i]) mod 2^64 over changed positions p_i (any superset
    of the changed positions gives the same sum: unchanged elements contribute zero).

    Computed as 2 * dot(d, p) + sum(d), d = T[new] - T[old], block by block in reused buffers that
    stay in cache (uint64 arithmetic wraps mod 2^64, as intended).
    """
    count = positions.size
    if count == 0:
        return 0
    where = positions.view(_U64) if positions.dtype == np.int64 else positions.astype(_U64)
    new_bits, old_bits = np.asarray(new).view(np.uint16), np.asarray(old).view(np.uint16)
    size = min(_SUM_BLOCK, count)
    diff, before, index = np.empty(size, dtype=_U64), np.empty(size, dtype=_U64), np.empty(size, dtype=np.intp)
    weighted = total = 0
    for a in range(0, count, _SUM_BLOCK):
        b = min(a + _SUM_BLOCK, count)
        d, e, i = diff[: b - a], before[: b - a], index[: b - a]
        # take converts a uint16 index to intp in a fresh array on every call; a reused one is cheaper.
        np.copyto(i, new_bits[a:b], casting="safe")
        np.take(_VALUE_HASH, i, out=d, mode="wrap")  # a uint16 is always in the table's range
        np.copyto(i, old_bits[a:b], casting="safe")
        np.take(_VALUE_HASH, i, out=e, mode="wrap")
        d -= e
        weighted += int(np.dot(d, where[a:b]))
        total += int(d.sum())
    return (2 * weighted + total) & _MASK64


def format_sum(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def bf16_bits(tensor: torch.Tensor, *, exact: bool = False) -> np.ndarray:
    """The tensor's values as bf16 bit patterns (flat uint16 numpy; a view for CPU bf16 tensors).

    fp32 is rounded to nearest-even (what the trainer publishes from its fp32 masters). With
    `exact`, fp32 that holds bf16 values (a reader's target) is truncated instead, which keeps every
    pattern, NaN payloads included, where rounding would canonicalise NaNs.
    """
    t = tensor.detach()
    if exact and t.dtype == torch.float32:
        t = (t.contiguous().view(torch.int32) >> 16).to(torch.int16)
    elif t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    t = t.cpu().contiguous().reshape(-1)
    return t.view(torch.int16).numpy().view(np.uint16)


def bits_checksum(bits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(bits).astype("<u2", copy=False).data).hexdigest()[:32]


def tensor_checksum(tensor: torch.Tensor, start: int = 0, stop: int | None = None) -> str:
    """Checksum of the bf16 bit pattern a reader's tensor holds in [start, stop) of its flat view
    (fp32 targets: exact upper halves)."""
    return bits_checksum(bf16_bits(tensor.detach().reshape(-1)[start:stop], exact=True))


def chunk_crc(data: bytes | memoryview) -> int:
    return zlib_ng.crc32(data) & 0xFFFFFFFF
