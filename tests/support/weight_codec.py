"""A whole-array reference path through the codec (encode one array against another, decode,
apply in place), for tests: the product applies streams through `weights.apply`."""

from __future__ import annotations

import numpy as np

from rljob.weights.changes import as_flat_bits, find_changes
from rljob.weights.codec import EncodedDelta, decode_positions, decode_steps, encode, ulp_unzigzag


def encode_delta(old_bits: np.ndarray, new_bits: np.ndarray) -> EncodedDelta:
    """The coding of the change from one flat bit-pattern array to another of the same size."""
    old, new = as_flat_bits(old_bits), as_flat_bits(new_bits)
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: {old.shape} vs {new.shape}")
    return encode(find_changes(old, new), int(new.size))


def decode(enc: EncodedDelta, old_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, new bit patterns) of a delta against the whole flat `old_bits`."""
    old = as_flat_bits(old_bits)
    if old.size != enc.numel:
        raise ValueError(f"delta is for {enc.numel} values, the array has {old.size}")
    positions = decode_positions(enc)
    return positions, ulp_unzigzag(old[positions], decode_steps(enc))


def apply_delta_bits(bits: np.ndarray, enc: EncodedDelta) -> None:
    """Apply a delta in place to a writable, contiguous array of 16-bit patterns."""
    flat = bits.reshape(-1).view(np.uint16)
    if flat.size and not np.shares_memory(flat, bits):
        raise ValueError("bits must be contiguous so the delta is applied in place")
    positions, values = decode(enc, flat)
    flat[positions] = values
