"""Lossless encodings of the change between two bf16 tensors, on their 16-bit patterns.

Pure numpy, no Python loop per element. A delta says *which* elements changed (positions) and
*what they are now* (values). Both halves have several codings and `encode_delta` keeps, per
tensor, the smallest:

positions
  ``rice``    sorted positions, gap-coded: each gap split into a unary quotient (one bit stream)
              and k low bits (a packed stream). Near the entropy of random sparse changes.
  ``bitmask`` one bit per element; wins when more than a few percent changed.
  ``dense``   no positions: every element is carried (most of the tensor changed).
values
  ``raw``     the new bf16 bit patterns, byte planes split (sign/exponent bytes compress well).
  ``ulp``     the signed distance, in units in the last place, from the old to the new value on
              the ordered bf16 number line, zig-zag coded. Most updates at small learning rates
              move a value by one or two ulp, so this is usually one byte or less per value.

Both value codings reproduce the new bit pattern exactly: ``raw`` is a plain overwrite, ``ulp``
an exact integer step from the old bit pattern (mod 2^16, so NaN, infinity and -0 round-trip).
``ulp`` needs the reader to hold exactly the base version, which the per-version checksums
guarantee; a publisher that wants pure overwrites sets ``overwrite_only``.
Every stream may additionally be zlib-compressed when that makes it smaller.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POSITION_CODECS = ("none", "rice", "bitmask", "dense")
VALUE_CODECS = ("raw", "ulp")

# A stream is only kept compressed when zlib saves at least this fraction; decompression is not free.
_MIN_ZLIB_SAVING = 0.03
_ZLIB_LEVEL = 6


class DeltaFormatError(ValueError):
    """An encoded delta is malformed (truncated stream, unknown codec, wrong sizes)."""


@dataclass(frozen=True)
class EncodedDelta:
    """The change of one flat bf16 tensor of `numel` elements, `count` of which changed."""

    numel: int
    count: int
    positions: str = "none"
    values: str = "raw"
    rice_k: int = 0
    value_width: int = 2  # bytes per coded value before compression
    streams: tuple[bytes, ...] = ()
    zipped: tuple[bool, ...] = ()
    raw_lengths: tuple[int, ...] = field(default=())  # uncompressed length of each stream

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (payload only; the metadata travels in the manifest)."""
        return sum(len(s) for s in self.streams)

    @property
    def encoding(self) -> str:
        """Human-readable name, e.g. ``rice+ulp1+z`` (z: at least one stream compressed)."""
        if self.positions == "none":
            return "none"
        width = self.value_width if self.values == "ulp" else ""
        return f"{self.positions}+{self.values}{width}" + ("+z" if any(self.zipped) else "")

    def meta(self) -> dict[str, Any]:
        """JSON-able description of everything but the payload bytes."""
        return {
            "numel": self.numel,
            "count": self.count,
            "positions": self.positions,
            "values": self.values,
            "rice_k": self.rice_k,
            "value_width": self.value_width,
            "lengths": [len(s) for s in self.streams],
            "zipped": list(self.zipped),
            "raw_lengths": list(self.raw_lengths),
        }

    def payload(self) -> bytes:
        return b"".join(self.streams)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], payload: bytes | memoryview) -> EncodedDelta:
        lengths = [int(n) for n in meta["lengths"]]
        if sum(lengths) != len(payload):
            raise DeltaFormatError(f"payload has {len(payload)} bytes, metadata says {sum(lengths)}")
        if meta["positions"] not in POSITION_CODECS or meta["values"] not in VALUE_CODECS:
            raise DeltaFormatError(f"unknown codec {meta['positions']}/{meta['values']}")
        view = memoryview(payload)
        streams, offset = [], 0
        for n in lengths:
            streams.append(bytes(view[offset : offset + n]))
            offset += n
        return cls(
            numel=int(meta["numel"]),
            count=int(meta["count"]),
            positions=meta["positions"],
            values=meta["values"],
            rice_k=int(meta["rice_k"]),
            value_width=int(meta["value_width"]),
            streams=tuple(streams),
            zipped=tuple(bool(z) for z in meta["zipped"]),
            raw_lengths=tuple(int(n) for n in meta["raw_lengths"]),
        )


# ---------------------------------------------------------------------------- bit-level helpers


def pack_fixed(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative integers (< 2**bits, bits <= 32) as consecutive big-endian bit fields."""
    if bits == 0 or values.size == 0:
        return b""
    as_bytes = values.astype(">u4").view(np.uint8).reshape(-1, 4)
    matrix = np.unpackbits(as_bytes, axis=1)[:, 32 - bits :]
    return np.packbits(matrix.reshape(-1)).tobytes()


def unpack_fixed(buf: bytes, count: int, bits: int) -> np.ndarray:
    """Inverse of `pack_fixed`; returns int64.

    Each field is read from the 32-bit big-endian window starting at its first byte, which holds
    the whole field as long as bits + 7 <= 32 (wider fields take the slower bit-matrix path).
    """
    if bits == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size * 8 < count * bits:
        raise DeltaFormatError(f"fixed-width stream too short: {raw.size} bytes for {count}x{bits} bits")
    if bits > 25:
        matrix = np.zeros((count, 32), dtype=np.uint8)
        matrix[:, 32 - bits :] = np.unpackbits(raw, count=count * bits).reshape(count, bits)
        return np.packbits(matrix, axis=1).view(">u4").reshape(-1).astype(np.int64)
    padded = np.concatenate([raw, np.zeros(4, dtype=np.uint8)]).astype(np.uint32)
    start = np.arange(count, dtype=np.int64) * bits
    first = start >> 3
    window = (padded[first] << 24) | (padded[first + 1] << 16) | (padded[first + 2] << 8) | padded[first + 3]
    shift = (32 - bits - (start & 7)).astype(np.uint32)
    return ((window >> shift) & np.uint32((1 << bits) - 1)).astype(np.int64)


def rice_cost_bits(gaps: np.ndarray, k: int) -> int:
    return int(gaps.size * (k + 1) + int(np.sum(gaps >> k)))


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that minimises the coded size (searched near log2 of the mean gap)."""
    mean = float(gaps.mean()) if gaps.size else 0.0
    guess = max(0, int(np.log2(mean + 1.0)))
    candidates = range(max(0, guess - 2), min(31, guess + 2) + 1)
    return min(candidates, key=lambda k: rice_cost_bits(gaps, k))


def rice_encode(positions: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Gap-code strictly increasing positions: (unary quotient bit stream, k-bit remainders)."""
    gaps = np.diff(positions, prepend=-1) - 1
    quotients = gaps >> k
    terminators = np.cumsum(quotients) + np.arange(positions.size)
    bits = np.zeros(int(terminators[-1]) + 1 if positions.size else 0, dtype=np.uint8)
    bits[terminators] = 1
    return np.packbits(bits).tobytes(), pack_fixed(gaps & ((1 << k) - 1), k)


def rice_decode(unary: bytes, low: bytes, count: int, k: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    terminators = np.flatnonzero(bits)[:count]
    if terminators.size != count:
        raise DeltaFormatError(f"rice stream holds {terminators.size} positions, expected {count}")
    quotients = np.diff(terminators, prepend=-1) - 1
    gaps = (quotients << k) | unpack_fixed(low, count, k)
    return np.cumsum(gaps + 1) - 1


def to_ordered(bits: np.ndarray) -> np.ndarray:
    """Map bf16 bit patterns onto an int16 number line where adjacent floats differ by one.

    Bijective and self-inverse: non-negative patterns keep their value; for negative ones (sign
    bit set) the 15 magnitude bits are flipped, so -0 -> -1 and one ulp either side of zero is one
    step. All in 16-bit integers, where numpy wraps around exactly mod 2^16.
    """
    signed = np.ascontiguousarray(bits).view(np.int16)
    return signed ^ ((signed >> 15) & np.int16(0x7FFF))


def from_ordered(ordered: np.ndarray) -> np.ndarray:
    return to_ordered(ordered).view(np.uint16)


def ulp_zigzag(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Signed ulp steps old -> new (wrapping mod 2^16, so exact for every pattern), zig-zag coded."""
    step = to_ordered(new) - to_ordered(old)
    return ((step << 1) ^ (step >> 15)).view(np.uint16)


def ulp_unzigzag(old: np.ndarray, zig: np.ndarray) -> np.ndarray:
    z = zig.astype(np.uint16)
    step = (z >> 1).view(np.int16) ^ -(z & 1).view(np.int16)
    return from_ordered(to_ordered(old) + step)


def _split_planes(values: np.ndarray) -> bytes:
    """uint16 -> low-byte plane then high-byte plane (sign/exponent bytes compress together)."""
    return values.astype("<u2").view(np.uint8).reshape(-1, 2).T.tobytes()


def _join_planes(buf: bytes, count: int) -> np.ndarray:
    planes = np.frombuffer(buf, dtype=np.uint8)
    if planes.size != 2 * count:
        raise DeltaFormatError(f"value stream has {planes.size} bytes, expected {2 * count}")
    return planes.reshape(2, count).T.copy().view("<u2").reshape(-1).astype(np.uint16)


def _maybe_zip(stream: bytes) -> tuple[bytes, bool]:
    if len(stream) < 64:
        return stream, False
    packed = zlib.compress(stream, _ZLIB_LEVEL)
    if len(packed) <= len(stream) * (1.0 - _MIN_ZLIB_SAVING):
        return packed, True
    return stream, False


def _unzip(stream: bytes, zipped: bool, raw_length: int) -> bytes:
    if not zipped:
        return stream
    try:
        out = zlib.decompress(stream)
    except zlib.error as exc:
        raise DeltaFormatError(f"corrupt compressed stream: {exc}") from exc
    if len(out) != raw_length:
        raise DeltaFormatError(f"stream inflated to {len(out)} bytes, expected {raw_length}")
    return out


# ---------------------------------------------------------------------------- value coding


def _encode_values(
    old: np.ndarray, new: np.ndarray, overwrite_only: bool, all_ulp: bool = False
) -> list[tuple[str, int, bytes]]:
    """Candidate value codings (codec, width, uncompressed stream) for changed elements."""
    raw = ("raw", 2, _split_planes(new))
    if overwrite_only:
        return [raw]
    zig = ulp_zigzag(old, new)
    if zig.size and int(zig.max()) < 256:
        # One byte per value before compression already beats any raw coding (2 bytes, high
        # byte rarely below 4 bits after zlib), so skip the cost of trying raw.
        return [("ulp", 1, zig.astype(np.uint8).tobytes())]
    if all_ulp:
        return [("ulp", 2, _split_planes(zig))]
    return [raw, ("ulp", 2, _split_planes(zig))]


def _decode_values(enc: EncodedDelta, stream: bytes, old: np.ndarray | None, count: int) -> np.ndarray:
    if enc.values == "raw":
        return _join_planes(stream, count)
    if old is None:
        raise ValueError("ulp-coded values need the old bit patterns at the changed positions")
    if enc.value_width == 1:
        zig = np.frombuffer(stream, dtype=np.uint8)
        if zig.size != count:
            raise DeltaFormatError(f"value stream has {zig.size} bytes, expected {count}")
    else:
        zig = _join_planes(stream, count)
    return ulp_unzigzag(old, zig)


def _pack(
    numel: int, count: int, positions: str, k: int, pos_streams: list[bytes], value: tuple[str, int, bytes]
) -> EncodedDelta:
    raw_streams = [*pos_streams, value[2]]
    packed = [_maybe_zip(s) for s in raw_streams]
    return EncodedDelta(
        numel=numel,
        count=count,
        positions=positions,
        values=value[0],
        rice_k=k,
        value_width=value[1],
        streams=tuple(p for p, _ in packed),
        zipped=tuple(z for _, z in packed),
        raw_lengths=tuple(len(s) for s in raw_streams),
    )


# ---------------------------------------------------------------------------- public API


def as_flat_bits(bits: np.ndarray) -> np.ndarray:
    """Check and flatten a bit-pattern array (any integer view of 16-bit values) to uint16."""
    if bits.dtype.itemsize != 2:
        raise TypeError(f"expected 16-bit patterns, got {bits.dtype}")
    return np.ascontiguousarray(bits).reshape(-1).view(np.uint16)


def encode_delta(
    old_bits: np.ndarray,
    new_bits: np.ndarray,
    *,
    overwrite_only: bool = False,
    positions: str | None = None,
    values: str | None = None,
) -> EncodedDelta:
    """Smallest lossless coding of `new_bits` given `old_bits` (same shape, 16-bit patterns).

    `positions` / `values` force one codec (tests and benchmarks compare them); otherwise every
    codec that can win is tried and the smallest kept.
    """
    if positions is not None and positions not in POSITION_CODECS[1:]:
        raise ValueError(f"positions must be one of {POSITION_CODECS[1:]}, got {positions!r}")
    if values is not None and values not in VALUE_CODECS:
        raise ValueError(f"values must be one of {VALUE_CODECS}, got {values!r}")
    force_raw = overwrite_only or values == "raw"
    old = as_flat_bits(old_bits)
    new = as_flat_bits(new_bits)
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: {old.shape} vs {new.shape}")
    numel = int(new.size)
    changed = old != new
    positions_ = np.flatnonzero(changed)
    count = int(positions_.size)
    if count == 0:
        return EncodedDelta(numel=numel, count=0)

    def wanted(codec: str) -> bool:
        return positions is None or positions == codec

    def value_options(old_v: np.ndarray, new_v: np.ndarray) -> list[tuple[str, int, bytes]]:
        return [v for v in _encode_values(old_v, new_v, force_raw, values == "ulp") if values in (None, v[0])]

    # Candidates in order of decoding cost; on equal size the first (cheapest to decode) wins.
    candidates: list[EncodedDelta] = []
    # A quarter or more changed: carrying every element may be cheapest.
    if wanted("dense") and (count * 4 >= numel or positions == "dense"):
        for value in value_options(old, new):
            candidates.append(_pack(numel, count, "dense", 0, [], value))
    sparse_values = value_options(old[positions_], new[positions_])
    gaps = np.diff(positions_, prepend=-1) - 1
    k = best_rice_k(gaps)
    rice_bytes = (rice_cost_bits(gaps, k) + 7) // 8
    mask_bytes = (numel + 7) // 8
    if wanted("bitmask") and ((count < numel and mask_bytes < 2 * rice_bytes) or positions == "bitmask"):
        mask = np.packbits(changed).tobytes()
        for value in sparse_values:
            candidates.append(_pack(numel, count, "bitmask", 0, [mask], value))
    if wanted("rice") and (count < numel or positions == "rice"):
        for value in sparse_values:
            candidates.append(_pack(numel, count, "rice", k, list(rice_encode(positions_, k)), value))
    return min(candidates, key=lambda c: c.nbytes)


def decode_positions(enc: EncodedDelta) -> np.ndarray:
    """Flat int64 positions of the changed elements (all of them for ``dense``)."""
    if enc.positions == "none":
        return np.zeros(0, dtype=np.int64)
    if enc.positions == "dense":
        return np.arange(enc.numel, dtype=np.int64)
    streams = [_unzip(s, z, n) for s, z, n in zip(enc.streams, enc.zipped, enc.raw_lengths, strict=True)]
    if enc.positions == "rice":
        positions = rice_decode(streams[0], streams[1], enc.count, enc.rice_k)
    elif enc.positions == "bitmask":
        mask = np.frombuffer(streams[0], dtype=np.uint8)
        if mask.size * 8 < enc.numel:
            raise DeltaFormatError(f"bitmask has {mask.size} bytes for {enc.numel} elements")
        positions = np.flatnonzero(np.unpackbits(mask, count=enc.numel))
    else:
        raise DeltaFormatError(f"unknown position codec {enc.positions!r}")
    if positions.size != enc.count or (positions.size and (positions[0] < 0 or positions[-1] >= enc.numel)):
        raise DeltaFormatError(f"decoded {positions.size} positions, expected {enc.count} within {enc.numel}")
    return positions


def decode_values(enc: EncodedDelta, old_at_positions: np.ndarray | None) -> np.ndarray:
    """New uint16 bit patterns for the positions `decode_positions` returns.

    `old_at_positions` (the base version's bits there) is needed for ``ulp`` coding only.
    """
    if enc.positions == "none":
        return np.zeros(0, dtype=np.uint16)
    count = enc.numel if enc.positions == "dense" else enc.count
    stream = _unzip(enc.streams[-1], enc.zipped[-1], enc.raw_lengths[-1])
    old = None if old_at_positions is None else as_flat_bits(old_at_positions)
    if old is not None and old.size != count:
        raise ValueError(f"{old.size} old values given for {count} positions")
    return _decode_values(enc, stream, old, count)


def decode_delta(enc: EncodedDelta, old_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, new bit patterns) of a delta against the full flat `old_bits`."""
    old = as_flat_bits(old_bits)
    if old.size != enc.numel:
        raise ValueError(f"delta is for {enc.numel} elements, tensor has {old.size}")
    positions = decode_positions(enc)
    needs_old = enc.values == "ulp"
    return positions, decode_values(enc, old[positions] if needs_old else None)


def apply_delta_bits(bits: np.ndarray, enc: EncodedDelta) -> None:
    """Apply a delta in place to a writable uint16/int16 numpy array of bit patterns."""
    flat = bits.reshape(-1).view(np.uint16)
    if flat.size and not np.shares_memory(flat, bits):
        raise ValueError("bits must be contiguous so the delta is applied in place")
    positions, values = decode_delta(enc, flat)
    flat[positions] = values
