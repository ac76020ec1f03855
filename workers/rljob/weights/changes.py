"""Finding where two arrays of bf16 bit patterns differ, with both sides' values there: the only
pass of the delta path over every value of the model (the publisher's, once per version).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# Elements compared per block in `find_changes`: large enough that per-call overhead (held under
# the GIL) weighs little when two threads share the pass (benchmarks/bench_weight_pass.py).
_COMPARE_BLOCK = 1 << 20


def as_flat_bits(bits: np.ndarray) -> np.ndarray:
    """Check and flatten a bit-pattern array (any integer view of 16-bit values) to uint16."""
    if bits.dtype.itemsize != 2:
        raise TypeError(f"expected 16-bit patterns, got {bits.dtype}")
    return np.ascontiguousarray(bits).reshape(-1).view(np.uint16)


@dataclass(frozen=True)
class Changes:
    """Where two flat bit-pattern arrays differ, and both sides' values there."""

    positions: np.ndarray  # int64, strictly increasing
    old: np.ndarray  # uint16
    new: np.ndarray  # uint16

    @property
    def count(self) -> int:
        return int(self.positions.size)


BlockSource = Callable[[int, int], np.ndarray]


def find_changes(old_bits: np.ndarray, new_bits: np.ndarray | BlockSource, *, advance: bool = False) -> Changes:
    """Where two bit-pattern arrays differ, with both sides' values there.

    One pass in cache-sized blocks into a reused bool buffer (a plain ``np.flatnonzero(old != new)``
    writes and rereads a mask the size of the tensor); the values are gathered while their block
    is still in cache. With `advance`, `old_bits` (then a writable flat uint16 array) is updated to
    the new values on the way, for the same reason. `new_bits` may be a function (start, stop) ->
    uint16 block, so that a caller can make each block just before it is compared (the publisher
    casts fp32 to bf16 that way, in cache).
    """
    old = as_flat_bits(old_bits)
    if callable(new_bits):
        block_of = new_bits
    else:
        new = as_flat_bits(new_bits)
        if old.shape != new.shape:
            raise ValueError(f"shape mismatch: {old.shape} vs {new.shape}")

        def block_of(start: int, stop: int) -> np.ndarray:
            return new[start:stop]

    if advance and old.size and not np.shares_memory(old, old_bits):  # an empty array shares nothing
        raise ValueError("advance needs a contiguous uint16 baseline to update in place")
    scratch = np.empty(min(_COMPARE_BLOCK, old.size), dtype=np.bool_)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for start in range(0, old.size, _COMPARE_BLOCK):
        stop = min(start + _COMPARE_BLOCK, old.size)
        old_block, new_block = old[start:stop], block_of(start, stop)
        differ = scratch[: stop - start]
        np.not_equal(old_block, new_block, out=differ)
        hit = np.flatnonzero(differ)
        if hit.size:
            was, now = old_block[hit], new_block[hit]
            if advance:
                old_block[hit] = now
            hit += start
            found.append((hit, was, now))
    if not found:
        return Changes(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.uint16))
    if len(found) == 1:
        return Changes(*found[0])
    return Changes(*(np.concatenate(parts) for parts in zip(*found, strict=True)))


def merge_changes(parts: Sequence[Changes], sizes: Sequence[int]) -> tuple[Changes, int]:
    """The changes of several flat arrays laid end to end (`sizes` elements each) as one, with
    positions counted from the first element of the first array; and the total element count."""
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    positions = np.empty(sum(c.count for c in parts), dtype=np.int64)
    at = 0
    for c, offset in zip(parts, offsets, strict=False):  # shifted straight into place: no copy per part
        np.add(c.positions, offset, out=positions[at : at + c.count])
        at += c.count
    empty = np.zeros(0, dtype=np.uint16)
    old = np.concatenate([c.old for c in parts]) if parts else empty
    new = np.concatenate([c.new for c in parts]) if parts else empty
    return Changes(positions, old, new), int(offsets[-1])
