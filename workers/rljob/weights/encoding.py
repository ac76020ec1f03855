"""Lossless encodings of the change between two bf16 tensors, on their 16-bit patterns.

Pure numpy, no Python loop per element. A delta says *which* elements changed (positions) and
*what they are now* (values). Both halves have several codings and `encode_delta` keeps, per
tensor, the smallest:

positions
  ``ef``      Elias-Fano: the low l bits of each position as whole bytes (l in 0, 8, 16) and the
              high parts as a unary bit stream. Within a fraction of a bit of Rice at the
              densities that matter, and the cheapest to code and decode (no gaps, no bit packing).
  ``rice``    sorted positions, gap-coded: each gap split into a unary quotient (one bit stream)
              and k low bits (a packed stream). Near the entropy of random sparse changes; used
              when it is clearly smaller than ``ef`` (very sparse or dense changes).
  ``bitmask`` one bit per element; wins when a large fraction changed.
  ``dense``   no positions: every element is carried (most of the tensor changed).
values
  ``raw``     the new bf16 bit patterns, byte planes split (sign/exponent bytes compress well).
  ``ulp``     the signed distance, in units in the last place, from the old to the new value on
              the ordered bf16 number line, zig-zag coded, one or two bytes each.
  ``ulpf``    the same distances in fixed-width bit fields (2 bits when every step is 1 or 2 ulp).
  ``ulpr``    the same distances Rice-coded, for when a few large steps would widen every field.
              Most updates at small learning rates move a value by one or two ulp: about two
              bits per value either way, no compressor needed.

Every value coding reproduces the new bit pattern exactly: ``raw`` is a plain overwrite, the
``ulp*`` codings an exact integer step from the old bit pattern (mod 2^16, so NaN, infinity and -0
round-trip). The ulp codings need the reader to hold exactly the base version, which the reader's
checks guarantee; a publisher that wants pure overwrites sets ``overwrite_only``.
Byte-oriented streams (raw planes, ulp bytes, bitmask) may be zlib-compressed when that makes them
smaller; Rice streams are already near their entropy and never are (zlib was most of encode time).
zlib runs with its run-length strategy: these planes have runs and skewed byte frequencies but
few longer repeats, so it is as small as level 6's string matching, or smaller, at a fifth of the
time or less (2.3 s -> 0.6 s to encode the first AdamW step of SmolLM2; a unit test checks the
size against level 6).

Speed: encoding and decoding are a fixed, small number of numpy passes over the *changed* values.
The only pass over all values is `find_changes`, which compares in cache-sized blocks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POSITION_CODECS = ("none", "rice", "bitmask", "dense", "ef")
VALUE_CODECS = ("raw", "ulp", "ulpr", "ulpf")
_POSITION_STREAMS = {"none": 0, "rice": 2, "bitmask": 1, "dense": 0, "ef": 2}
_VALUE_STREAMS = {"raw": 1, "ulp": 1, "ulpr": 2, "ulpf": 1}
_EF_LOW_BITS = (0, 8, 16)  # whole bytes: the low parts need no bit packing
# Rice replaces Elias-Fano only when it is at least this much smaller (EF is faster both ways).
_RICE_OVER_EF = 0.85

# A stream is only kept compressed when zlib saves at least this fraction; decompression is not free.
_MIN_ZLIB_SAVING = 0.03
_ZLIB_LEVEL = 1  # with Z_RLE the level hardly matters: there is no string matching to tune
# Above this many ulp, a raw overwrite may be smaller than the Rice-coded step: try both.
_ULP_RAW_THRESHOLD = 1 << 12
# Wide-step value codings are built and compressed only when their estimated size is within this
# factor of the smallest estimate (the estimates of zlib streams are sampled).
_KEEP_WITHIN = 1.10
_ZIP_SAMPLES, _ZIP_SAMPLE_BYTES = 16, 1 << 16
# Elements compared per block in `find_changes`: large enough that per-call overhead (held under
# the GIL) weighs less when two threads share the pass (benchmarks/bench_weight_pass.py, 2 threads:
# 136-141 ms per model pass with 1M-element blocks vs 166-196 ms with 256K over three runs).
_COMPARE_BLOCK = 1 << 20
_U64 = np.uint64
# best_rice_k looks at about this many values (each candidate k costs a pass over them).
_RICE_K_SAMPLE = 1 << 18
# Values per block in `ulp_unzigzag` (its two int16 buffers stay in L1/L2).
_ULP_BLOCK = 1 << 16


class DeltaFormatError(ValueError):
    """An encoded delta is malformed (truncated stream, unknown codec, wrong sizes)."""


@dataclass(frozen=True)
class EncodedDelta:
    """The change of one flat bf16 tensor of `numel` elements, `count` of which changed."""

    numel: int
    count: int
    positions: str = "none"
    values: str = "raw"
    rice_k: int = 0  # ``rice``: Rice parameter; ``ef``: low bits per position
    value_width: int = 2  # ``ulp``: bytes per coded value before compression
    streams: tuple[bytes, ...] = ()
    zipped: tuple[bool, ...] = ()
    raw_lengths: tuple[int, ...] = field(default=())  # uncompressed length of each stream
    value_k: int = 0  # ``ulpr``: Rice parameter of the value stream; ``ulpf``: field width in bits

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (payload only; the metadata travels in the manifest)."""
        return sum(len(s) for s in self.streams)

    @property
    def encoding(self) -> str:
        """Human-readable name, e.g. ``rice+ulpr0`` or ``rice+ulp1+z`` (z: a stream is compressed)."""
        if self.positions == "none":
            return "none"
        width = {"raw": "", "ulp": self.value_width, "ulpr": self.value_k, "ulpf": self.value_k}[self.values]
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
            "value_k": self.value_k,
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
        expected = 0
        if meta["positions"] != "none":
            expected = _POSITION_STREAMS[meta["positions"]] + _VALUE_STREAMS[meta["values"]]
        if not len(lengths) == len(meta["zipped"]) == len(meta["raw_lengths"]) == expected:
            raise DeltaFormatError(f"{meta['positions']}/{meta['values']} needs {expected} streams, got {len(lengths)}")
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
            value_k=int(meta.get("value_k", 0)),  # absent in format-1 manifests (no ulpr then)
        )


# ---------------------------------------------------------------------------- bit-level helpers


def _group(bits: int) -> int:
    """Fields per whole-byte group (g * bits is a multiple of 8), or 0 when a group overflows 64 bits."""
    g = 8 // math.gcd(bits, 8)
    return g if g * bits <= 64 else 0


def fast_width(bits: int) -> bool:
    """Widths `pack_fixed` handles a whole group at a time (all <= 8, even <= 16, multiples of 4)."""
    return bits == 0 or (bits <= 32 and _group(bits) > 0)


_FAST_WIDTHS = tuple(k for k in range(32) if fast_width(k))


_WORD_TYPES = {8: ">u1", 16: ">u2", 32: ">u4", 64: ">u8"}


def _word_type(group_bits: int) -> tuple[str, int]:
    """The narrowest big-endian integer that holds a group, and its size in bits."""
    size = next(size for size in (8, 16, 32, 64) if group_bits <= size)
    return _WORD_TYPES[size], size


def pack_fixed(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative integers (< 2**bits, bits <= 32) as consecutive big-endian bit fields."""
    if bits == 0 or values.size == 0:
        return b""
    if not 0 < bits <= 32:
        raise ValueError(f"field width must be 1..32 bits, got {bits}")
    group = _group(bits)
    if not group:
        return _pack_fixed_words(values, bits)
    if bits in _BYTE_ASSEMBLY_WIDTHS:
        return _pack_by_bytes(values, bits)
    word_type, word_bits = _word_type(group * bits)
    if group == 1 and word_bits == bits:  # whole bytes: a plain cast
        return values.astype(word_type).tobytes()
    return _pack_group_words(values, bits)


def _pack_group_words(values: np.ndarray, bits: int) -> bytes:
    """`group` fields fill exactly group*bits/8 bytes: build each group's bits in one word."""
    group = _group(bits)
    word_type, word_bits = _word_type(group * bits)
    n = values.size
    rows = -(-n // group)
    native = np.dtype(word_type).newbyteorder("=")
    padded = np.zeros(rows * group, dtype=native)
    padded[:n] = values
    cols = padded.reshape(rows, group)
    word = cols[:, 0] << native.type(bits * (group - 1))
    for j in range(1, group):
        word |= cols[:, j] << native.type(bits * (group - 1 - j))
    width = group * bits // 8
    grid = word.astype(word_type).view(np.uint8).reshape(rows, word_bits // 8)[:, word_bits // 8 - width :]
    return grid.tobytes()[: (n * bits + 7) // 8]


def _pack_by_bytes(values: np.ndarray, bits: int) -> bytes:
    """Widths 3, 5, 6 and 7 (groups of 3, 5, 3 or 7 bytes): each byte of a group ORed together
    from the two or three fields that overlap it, on narrow columns (1.6-3.7x `_pack_group_words`,
    which shifts every field into a 32- or 64-bit word and byte-swaps it:
    benchmarks/bench_weight_kernels.py)."""
    n, group = values.size, _group(bits)
    width, rows = group * bits // 8, -(-n // group)
    fields = np.zeros(rows * group, dtype=np.uint16)
    fields[:n] = values
    columns = fields.reshape(rows, group)
    grid = np.empty((rows, width), dtype=np.uint8)
    byte, part = np.empty(rows, dtype=np.uint16), np.empty(rows, dtype=np.uint16)
    for j in range(width):
        byte[:] = 0
        for f in range(group):
            first, end = f * bits, (f + 1) * bits  # the field's bits within the group, first bit first
            if end <= 8 * j or first >= 8 * (j + 1):
                continue
            shift = 8 * (j + 1) - end  # moves the field's last bit to its place in byte j
            if shift >= 0:
                np.left_shift(columns[:, f], shift, out=part)
            else:
                np.right_shift(columns[:, f], -shift, out=part)
            byte |= part
        np.copyto(grid[:, j], byte, casting="unsafe")  # the low 8 bits
    return grid.tobytes()[: (n * bits + 7) // 8]


def _pack_fixed_words(values: np.ndarray, bits: int) -> bytes:
    """Any width <= 32: each field lands in at most two 64-bit words; OR them per word."""
    n = values.size
    x = values.astype(_U64) << _U64(64 - bits)  # field at the top of a word
    start = np.arange(0, n * bits, bits, dtype=_U64)
    word = start >> _U64(6)
    offset = start & _U64(63)
    head = x >> offset
    tail = (x << _U64(1)) << (_U64(63) - offset)  # what spilled past the word's end (0 if nothing)
    firsts = np.flatnonzero(np.diff(word, prepend=_U64(2**63)))
    used = word[firsts].astype(np.intp)
    words = np.zeros(int(used[-1]) + 2, dtype=_U64)
    words[used] = np.bitwise_or.reduceat(head, firsts)
    words[used + 1] |= np.bitwise_or.reduceat(tail, firsts)
    return words.astype(">u8").tobytes()[: (n * bits + 7) // 8]


def unpack_fixed(buf: bytes, count: int, bits: int, dtype: type = np.int64) -> np.ndarray:
    """Inverse of `pack_fixed`; returns int64 (or `dtype`, which must hold `bits` bits)."""
    if bits == 0 or count == 0:
        return np.zeros(count, dtype=dtype)
    if not 0 < bits <= 32:
        raise DeltaFormatError(f"field width must be 1..32 bits, got {bits}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size * 8 < count * bits:
        raise DeltaFormatError(f"fixed-width stream too short: {raw.size} bytes for {count}x{bits} bits")
    if bits in _BYTE_TABLES:  # 1, 2 or 4 bits: one table lookup per byte, all its fields as one word
        fields = _BYTE_TABLES[bits][raw[: (count * bits + 7) // 8]].view(np.uint8)[:count]
        return fields.astype(dtype)
    if bits in _CHUNK_TABLES:
        return _unpack_by_chunks(raw, count, bits).astype(dtype, copy=False)
    group = _group(bits)
    if not group:
        return _unpack_fixed_words(raw, count, bits).astype(dtype, copy=False)
    word_type, word_bits = _word_type(group * bits)
    if group == 1 and word_bits == bits:
        return np.frombuffer(buf, dtype=word_type, count=count).astype(dtype)
    return _unpack_group_words(raw, count, bits, dtype)


def _unpack_group_words(raw: np.ndarray, count: int, bits: int, dtype: type) -> np.ndarray:
    """Inverse of `_pack_group_words`: each group's bytes as one word, then each field shifted out."""
    group = _group(bits)
    word_type, word_bits = _word_type(group * bits)
    width, word_bytes = group * bits // 8, word_bits // 8
    rows = -(-count // group)
    grid = np.zeros((rows, word_bytes), dtype=np.uint8)
    flat = np.zeros(rows * width, dtype=np.uint8)
    used = min(raw.size, flat.size)
    flat[:used] = raw[:used]
    grid[:, word_bytes - width :] = flat.reshape(rows, width)
    native = np.dtype(word_type).newbyteorder("=")
    word = grid.view(word_type).reshape(rows).astype(native)
    out = np.empty((rows, group), dtype=dtype)
    mask = native.type((1 << bits) - 1)
    for j in range(group):
        out[:, j] = (word >> native.type(bits * (group - 1 - j))) & mask
    return out.reshape(-1)[:count]


def _byte_table(bits: int) -> np.ndarray:
    """Entry b: the 8 / bits fields of byte value b (first field in the high bits) as one byte
    each, packed into one 2-, 4- or 8-byte word, so a lookup is a flat gather (a gather of 2-D rows
    is about 5x slower in numpy)."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte - 1, -1, -1, dtype=np.uint8) * np.uint8(bits)
    rows = (np.arange(256, dtype=np.uint8)[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    table = np.ascontiguousarray(rows).view(f"u{per_byte}").reshape(256)
    table.setflags(write=False)
    return table


_BYTE_TABLES = {bits: _byte_table(bits) for bits in (1, 2, 4)}


def _chunk_table(bits: int, per: int) -> np.ndarray:
    """Entry c: the `per` fields of the (per * bits)-bit chunk c, one byte each, as one word."""
    shifts = np.arange(per - 1, -1, -1, dtype=np.uint32) * np.uint32(bits)
    rows = (np.arange(1 << (per * bits), dtype=np.uint32)[:, None] >> shifts) & np.uint32((1 << bits) - 1)
    table = np.ascontiguousarray(rows.astype(np.uint8)).view(f"u{per}").reshape(-1)
    table.setflags(write=False)
    return table


# Widths 3 and 6 (a group of fields is 3 bytes): looked up four or two fields at a time from the
# group's two 12-bit halves (tables of 4096 entries). 1.7-2.1x (3 bits; Rice remainders at 3-10%
# density) and 1.2-1.4x (6 bits) faster than shifting each field out of a group word
# (benchmarks/bench_weight_kernels.py); 5- and 7-bit chunks gained nothing, so those widths do not.
_CHUNK_TABLES = {bits: (per, _chunk_table(bits, per)) for bits, per in ((3, 4), (6, 2))}
# Widths whose groups `_pack_by_bytes` assembles byte by byte.
_BYTE_ASSEMBLY_WIDTHS = (3, 5, 6, 7)


def _unpack_by_chunks(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    """uint8 fields of a `_CHUNK_TABLES` width: chunk indices built from the group's bytes (each
    chunk spans two or three of them), then one table gather per chunk."""
    per, table = _CHUNK_TABLES[bits]
    group = _group(bits)
    width, chunks, chunk_bits = group * bits // 8, group // per, per * bits
    rows = -(-count // group)
    if raw.size >= rows * width:
        grid = raw[: rows * width].reshape(rows, width)
    else:
        grid = np.zeros(rows * width, dtype=np.uint8)
        grid[: raw.size] = raw
        grid = grid.reshape(rows, width)
    out = np.empty((rows, chunks), dtype=table.dtype)
    index = np.empty(rows, dtype=np.uint32)
    for j in range(chunks):
        first, last = j * chunk_bits // 8, ((j + 1) * chunk_bits - 1) // 8
        np.copyto(index, grid[:, first], casting="unsafe")
        for b in range(first + 1, last + 1):
            index <<= np.uint32(8)
            index |= grid[:, b]
        index >>= np.uint32(8 * (last + 1) - (j + 1) * chunk_bits)
        index &= np.uint32((1 << chunk_bits) - 1)
        np.take(table, index, out=out[:, j])
    return out.view(np.uint8).reshape(-1)[:count]


def _unpack_fixed_words(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    padded = np.zeros(((raw.size + 7) // 8 + 1) * 8, dtype=np.uint8)
    padded[: raw.size] = raw
    words = padded.view(">u8").astype(_U64)
    start = np.arange(0, count * bits, bits, dtype=_U64)
    word = (start >> _U64(6)).astype(np.intp)
    offset = start & _U64(63)
    # (next >> 1) >> (63 - offset) is next >> (64 - offset), and 0 when offset is 0.
    both = (words[word] << offset) | ((words[word + 1] >> _U64(1)) >> (_U64(63) - offset))
    return (both >> _U64(64 - bits)).astype(np.int64)


def rice_cost_bits(values: np.ndarray, k: int) -> int:
    return int(values.size * (k + 1) + int(np.sum(values >> k)))


def best_rice_k(values: np.ndarray) -> int:
    """The Rice parameter that minimises the coded size, among widths `pack_fixed` packs fast.

    Searched next to log2 of the mean (where the optimum of a geometric distribution lies); the
    fast-width restriction costs at most a fraction of a bit.
    """
    if values.size == 0:
        return 0
    if values.size > _RICE_K_SAMPLE:  # choosing k needs only the distribution: a strided sample
        values = values[:: values.size // _RICE_K_SAMPLE]
    total = int(values.sum())
    guess = max(0, int(np.log2(total / values.size * 0.69 + 1.0)))
    candidates = [k for k in _FAST_WIDTHS if guess - 1 <= k <= guess + 2]

    def cost(k: int) -> int:
        return values.size * (k + 1) + (total if k == 0 else int(np.sum(values >> k)))

    return min(candidates, key=cost)


def estimate_rice_bits(count: int, gap_sum: int) -> int:
    """Approximate Rice size of `count` geometric gaps summing to `gap_sum` (no pass over them):
    the quotients sum to about gap_sum / 2^k less half a unit per gap for the rounding down."""
    if count == 0:
        return 0

    def cost(k: int) -> int:
        return count * (k + 1) + max(0, (gap_sum >> k) - ((count * ((1 << k) - 1)) >> (k + 1)))

    # The optimum is near log2 of the mean gap; a few widths either side cover the rounding.
    guess = max(0, (gap_sum // count).bit_length() - 1)
    return min(cost(k) for k in _FAST_WIDTHS if guess - 3 <= k <= guess + 3)


def ef_cost_bits(count: int, numel: int, low_bits: int) -> int:
    return count * (low_bits + 1) + (numel >> low_bits) + 1


def best_ef_bits(count: int, numel: int) -> int:
    return min(_EF_LOW_BITS, key=lambda low: ef_cost_bits(count, numel, low))


def ef_pack(positions: np.ndarray, low_bits: int) -> tuple[bytes, bytes]:
    """Elias-Fano: (unary stream of the high parts, bit i + high_i set; low parts as bytes)."""
    if positions.size == 0:
        return b"", b""
    high = positions >> low_bits
    high += np.arange(positions.size)
    bits = np.zeros(int(high[-1]) + 1, dtype=np.uint8)
    bits[high] = 1
    lower = positions.astype(_WORD_TYPES[low_bits]).tobytes() if low_bits else b""  # the cast keeps the low bits
    return np.packbits(bits).tobytes(), lower


def ef_unpack(upper: bytes, lower: bytes, count: int, low_bits: int) -> np.ndarray:
    if low_bits not in _EF_LOW_BITS:
        raise DeltaFormatError(f"Elias-Fano low parts of {low_bits} bits are not a supported width")
    positions = _terminators(upper, count)
    positions -= np.arange(count)
    if low_bits:
        positions <<= low_bits
        positions |= unpack_fixed(lower, count, low_bits, dtype=_field_type(low_bits))
    return positions


def rice_pack(values: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice-code non-negative integers: (unary quotient bit stream, k-bit remainders)."""
    if values.size == 0:
        return b"", b""
    # The i-th terminator sits at sum_{j <= i} (quotient_j + 1) - 1.
    terminators = values >> k
    terminators += 1
    np.cumsum(terminators, out=terminators)
    terminators -= 1
    bits = np.zeros(int(terminators[-1]) + 1, dtype=np.uint8)
    bits[terminators] = 1
    return np.packbits(bits).tobytes(), pack_fixed(values & ((1 << k) - 1), k)


def _field_type(bits: int) -> type:
    """The narrowest unsigned integer holding `bits`-bit fields (narrow outputs unpack faster)."""
    return np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32


def _terminators(unary: bytes, count: int) -> np.ndarray:
    # Viewed as bool, the 0/1 bytes take numpy's fast nonzero path (5x the uint8 one, benchmarks/bench_weight_pass.py).
    terminators = np.flatnonzero(np.unpackbits(np.frombuffer(unary, dtype=np.uint8)).view(np.bool_))[:count]
    if terminators.size != count:
        raise DeltaFormatError(f"rice stream holds {terminators.size} values, expected {count}")
    return terminators


def rice_unpack(unary: bytes, low: bytes, count: int, k: int) -> np.ndarray:
    """Inverse of `rice_pack` (int64)."""
    terminators = _terminators(unary, count)
    quotients = np.diff(terminators, prepend=-1)
    quotients -= 1
    if k == 0:
        return quotients
    quotients <<= k
    quotients |= unpack_fixed(low, count, k, dtype=_field_type(k))
    return quotients


def _gaps(positions: np.ndarray) -> np.ndarray:
    gaps = np.empty_like(positions)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def rice_encode(positions: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Gap-code strictly increasing positions: (unary quotient bit stream, k-bit remainders)."""
    return rice_pack(_gaps(positions), k)


def rice_decode(unary: bytes, low: bytes, count: int, k: int) -> np.ndarray:
    # The i-th terminator t_i sits at (sum of the first i+1 quotients) + i, so position i is
    # (t_i - i) * 2^k + i + (running sum of the remainders), which is
    # t_i * 2^k + (running sum of (remainder + 1 - 2^k)) + 2^k - 1: no ramp of i is materialised.
    terminators = _terminators(unary, count)
    if k == 0:
        return terminators
    # Narrow integers where they cannot overflow: these passes are memory-bound, so fewer bytes
    # per value is faster (the remainders as int8 for k <= 7, their running sum as int32).
    shifted = unpack_fixed(low, count, k, dtype=np.int8 if k <= 7 else np.int16 if k <= 15 else np.int32)
    shifted -= shifted.dtype.type((1 << k) - 1)
    total_type = np.int32 if count * ((1 << k) - 1) < 2**31 else np.int64
    terminators <<= k
    terminators += np.cumsum(shifted, dtype=total_type)
    terminators += (1 << k) - 1
    return terminators


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
    """Inverse of `ulp_zigzag`: new patterns from the old ones and the zig-zag steps.

    In blocks with two small reused buffers and in-place ufuncs (the same arithmetic as
    `to_ordered` / `from_ordered`): 2.1x the whole-array expressions at 10% density
    (benchmarks/bench_weight_kernels.py), whose dozen fresh temporaries each cost a pass through
    memory and its page faults.
    """
    count = old.size
    out = np.empty(count, dtype=np.uint16)
    if count == 0:
        return out
    old_s = np.ascontiguousarray(old).reshape(-1).view(np.int16)
    zig_u = np.ascontiguousarray(zig, dtype=np.uint16).reshape(-1)
    step_buf, sign_buf = np.empty(min(_ULP_BLOCK, count), dtype=np.int16), np.empty(min(_ULP_BLOCK, count), np.int16)
    magnitude = np.int16(0x7FFF)
    result = out.view(np.int16)
    for a in range(0, count, _ULP_BLOCK):
        b = min(a + _ULP_BLOCK, count)
        step, sign, z, o, r = step_buf[: b - a], sign_buf[: b - a], zig_u[a:b], old_s[a:b], result[a:b]
        np.right_shift(z, 1, out=step.view(np.uint16))  # step = (z >> 1) ^ -(z & 1)
        np.bitwise_and(z, 1, out=sign.view(np.uint16))
        np.negative(sign, out=sign)
        step ^= sign
        np.right_shift(o, 15, out=sign)  # r = to_ordered(old) + step
        sign &= magnitude
        np.bitwise_xor(o, sign, out=r)
        r += step
        np.right_shift(r, 15, out=sign)  # r = from_ordered(r)
        sign &= magnitude
        r ^= sign
    return out


def _split_planes(values: np.ndarray) -> bytes:
    """uint16 -> low-byte plane then high-byte plane (sign/exponent bytes compress together)."""
    return values.astype("<u2").view(np.uint8).reshape(-1, 2).T.tobytes()


def _join_planes(buf: bytes, count: int) -> np.ndarray:
    planes = np.frombuffer(buf, dtype=np.uint8)
    if planes.size != 2 * count:
        raise DeltaFormatError(f"value stream has {planes.size} bytes, expected {2 * count}")
    out = np.empty(count, dtype="<u2")
    interleaved = out.view(np.uint8)
    interleaved[0::2] = planes[:count]  # two strided copies: 9x faster than copying a transpose
    interleaved[1::2] = planes[count:]
    return out.astype(np.uint16, copy=False)


def _maybe_zip(stream: bytes) -> tuple[bytes, bool]:
    if len(stream) < 64:
        return stream, False
    compressor = zlib.compressobj(_ZLIB_LEVEL, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    packed = compressor.compress(stream) + compressor.flush()
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


# ---------------------------------------------------------------------------- finding changes


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

    One pass in cache-sized blocks into a reused bool buffer (about twice as fast as a plain
    ``np.flatnonzero(old != new)``, which writes and rereads a mask the size of the tensor); the
    values are gathered while their block is still in cache. With `advance`, `old_bits` (which must
    then be a writable flat uint16 array) is updated to the new values on the way, for the same
    reason. `new_bits` may be a function (start, stop) -> uint16 block, so that a caller can make
    each block just before it is compared (the publisher casts fp32 to bf16 that way, in cache).
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

    if advance and not np.shares_memory(old, old_bits):
        raise ValueError("advance needs a contiguous uint16 baseline to update in place")
    scratch = np.empty(min(_COMPARE_BLOCK, old.size), dtype=np.bool_)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for start in range(0, old.size, _COMPARE_BLOCK):
        stop = min(start + _COMPARE_BLOCK, old.size)
        old_block, new_block = old[start:stop], block_of(start, stop)
        hit, was, now = _block_changes(old_block, new_block, scratch, advance)
        if hit.size:
            hit += start
            found.append((hit, was, now))
    if not found:
        return Changes(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.uint16))
    if len(found) == 1:
        return Changes(*found[0])
    return Changes(*(np.concatenate(parts) for parts in zip(*found, strict=True)))


def _block_changes(
    old: np.ndarray, new: np.ndarray, scratch: np.ndarray, advance: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changes within one block (positions local to it), compared four values at a time.

    The block is compared as 64-bit words first, so numpy's nonzero (the costly step: about 1 ns
    per element) scans a quarter as many flags; only the words that differ are split into their
    four values: 1.06-1.16x the per-value comparison at 1% and 10% density
    (benchmarks/bench_weight_kernels.py). Where most words differ (dense changes), the per-value
    comparison is used instead.
    """
    whole = old.size - old.size % 4
    old_words, new_words = old[:whole].view(np.uint64), new[:whole].view(np.uint64)
    word_differs = scratch[: whole // 4]
    np.not_equal(old_words, new_words, out=word_differs)
    words = np.flatnonzero(word_differs)
    if words.size * 2 > word_differs.size or whole < old.size:  # dense, or a tail that is not a word
        differ = scratch[: old.size]
        np.not_equal(old, new, out=differ)
        hit = np.flatnonzero(differ)
        was, now = old[hit], new[hit]
        if advance:
            old[hit] = now
        return hit, was, now
    old_lanes, new_lanes = old_words[words].view(np.uint16), new_words[words].view(np.uint16)
    lanes = np.flatnonzero(old_lanes != new_lanes)
    hit = words[lanes >> 2]
    hit <<= 2
    hit += lanes & 3
    if advance:
        old_words[words] = new_words[words]  # whole words: their unchanged values are equal anyway
    return hit, old_lanes[lanes], new_lanes[lanes]


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
    merged = Changes(positions, np.concatenate([c.old for c in parts]), np.concatenate([c.new for c in parts]))
    return merged, int(offsets[-1])


def changed_positions(old_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """Flat int64 positions where two bit-pattern arrays differ."""
    return find_changes(old_bits, new_bits).positions


# ---------------------------------------------------------------------------- value coding


# A value coding: codec, width or Rice k, its streams, and which of them are worth compressing.
ValueCoding = tuple[str, int, list[bytes], list[bool]]


def _encode_values(
    old: np.ndarray, new: np.ndarray, forced: str | None, overwrite_only: bool, bias: int
) -> list[ValueCoding]:
    """Candidate value codings (codec, width or k, streams, compress-worthy flags) for changed values.

    `bias` is subtracted from the zig-zag steps before they are coded: 1 where every coded value
    changed (a step is never 0), 0 for ``dense``.
    """

    def raw() -> ValueCoding:
        return ("raw", 2, [_split_planes(new)], [True])

    if overwrite_only or forced == "raw":
        return [raw()]
    zig = ulp_zigzag(old, new)
    if forced == "ulp":
        if zig.size and int(zig.max()) < 256:
            return [("ulp", 1, [zig.astype(np.uint8).tobytes()], [True])]
        return [("ulp", 2, [_split_planes(zig)], [True])]
    steps = zig - np.uint16(bias) if bias else zig  # uint16; a changed value's step is never 0
    top = int(steps.max()) if steps.size else 0
    width = max(1, top.bit_length())

    def fixed() -> ValueCoding:
        return ("ulpf", width, [pack_fixed(steps, width)], [False])

    if forced == "ulpf" or (forced is None and width <= 2):
        # Two bits or fewer: Rice cannot be much smaller, and fixed fields decode fastest.
        return [fixed()]
    k = best_rice_k(steps)
    rice_bits = rice_cost_bits(steps, k)
    coded: Callable[[], ValueCoding]
    if forced is None and steps.size * width * 0.95 <= rice_bits:
        coded, coded_bytes = fixed, (steps.size * width + 7) // 8
    else:

        def coded() -> ValueCoding:
            return ("ulpr", k, list(rice_pack(steps.astype(np.int64), k)), [False, False])

        coded_bytes = (rice_bits + 7) // 8 + 1  # two streams, each rounded up to whole bytes
    if forced is not None or width <= 4:
        return [coded()]
    # Wide steps (real optimizer updates move small weights by many ulp): the byte coding with
    # zlib, or a plain overwrite when steps are huge, can be smaller.
    byte_coded = _encode_values(old, new, "ulp", False, bias)[0]
    options = [(coded, coded_bytes), (lambda: byte_coded, _zipped_size_estimate(byte_coded[2][0]))]
    if top >= _ULP_RAW_THRESHOLD:
        overwrite = raw()
        options.append((lambda: overwrite, _zipped_size_estimate(overwrite[2][0])))
    return _near_smallest(options)


def _near_smallest(options: list[tuple[Callable[[], ValueCoding], int]]) -> list[ValueCoding]:
    """Build only the candidates whose size (exact, or a sampled estimate for zlib streams) is
    within `_KEEP_WITHIN` of the smallest; the caller compresses them and keeps the smallest. On
    the first AdamW step of SmolLM2 the zipped byte coding is 4-7x smaller than the Rice-coded steps
    and the zipped overwrite, so those two are never packed nor compressed."""
    smallest = min(size for _, size in options)
    return [build() for build, size in options if size <= _KEEP_WITHIN * smallest]


def _zipped_size_estimate(stream: bytes) -> int:
    """Size of `stream` after `_maybe_zip`: exact for small streams; for large ones, scaled from
    `_ZIP_SAMPLES` evenly spaced pieces of `_ZIP_SAMPLE_BYTES`, which cover both byte planes
    (tests/unit/test_weight_encoding.py holds it within 5% on AdamW-like steps)."""
    n = len(stream)
    if n <= 2 * _ZIP_SAMPLES * _ZIP_SAMPLE_BYTES:
        return len(_maybe_zip(stream)[0])
    starts = np.linspace(0, n - _ZIP_SAMPLE_BYTES, _ZIP_SAMPLES).astype(np.int64)
    sampled = sum(len(_maybe_zip(stream[a : a + _ZIP_SAMPLE_BYTES])[0]) for a in starts)
    return min(n, int(sampled / (_ZIP_SAMPLES * _ZIP_SAMPLE_BYTES) * n))


def _decode_values(enc: EncodedDelta, streams: list[bytes], old: np.ndarray | None, count: int) -> np.ndarray:
    if enc.values == "raw":
        return _join_planes(streams[0], count)
    if old is None:
        raise ValueError("ulp-coded values need the old bit patterns at the changed positions")
    if enc.values in ("ulpr", "ulpf"):
        if enc.values == "ulpr":
            steps = rice_unpack(streams[0], streams[1], count, enc.value_k)
            if count and int(steps.max()) > (0xFFFF if enc.positions == "dense" else 0xFFFE):
                raise DeltaFormatError("ulp step outside 16 bits")
            steps = steps.astype(np.uint16)
        else:
            if enc.value_k > 16:
                raise DeltaFormatError(f"ulp fields of {enc.value_k} bits exceed 16")
            steps = unpack_fixed(streams[0], count, enc.value_k, dtype=np.uint16)
        if enc.positions != "dense":
            steps += np.uint16(1)
        return ulp_unzigzag(old, steps)
    if enc.value_width == 1:
        zig = np.frombuffer(streams[0], dtype=np.uint8)
        if zig.size != count:
            raise DeltaFormatError(f"value stream has {zig.size} bytes, expected {count}")
    else:
        zig = _join_planes(streams[0], count)
    return ulp_unzigzag(old, zig)


def _pack(
    numel: int,
    count: int,
    positions: str,
    k: int,
    pos_streams: list[tuple[bytes, bool]],
    value: tuple[str, int, list[bytes], list[bool]],
) -> EncodedDelta:
    raw_streams = [s for s, _ in pos_streams] + value[2]
    worth = [w for _, w in pos_streams] + value[3]
    packed = [_maybe_zip(s) if w else (s, False) for s, w in zip(raw_streams, worth, strict=True)]
    return EncodedDelta(
        numel=numel,
        count=count,
        positions=positions,
        values=value[0],
        rice_k=k,
        value_width=value[1] if value[0] in ("raw", "ulp") else 0,
        value_k=value[1] if value[0] in ("ulpr", "ulpf") else 0,
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
    changes: Changes | None = None,
) -> EncodedDelta:
    """Smallest lossless coding of `new_bits` given `old_bits` (same shape, 16-bit patterns).

    `positions` / `values` force one codec (tests and benchmarks compare them); otherwise every
    codec that can win is tried and the smallest kept. `changes`, when the caller already has
    them (`find_changes`), saves the comparison pass; `old_bits` is then not read (only its shape
    is checked), so it may already hold the new values (see `find_changes(advance=True)`).
    """
    if positions is not None and positions not in POSITION_CODECS[1:]:
        raise ValueError(f"positions must be one of {POSITION_CODECS[1:]}, got {positions!r}")
    if values is not None and values not in VALUE_CODECS:
        raise ValueError(f"values must be one of {VALUE_CODECS}, got {values!r}")
    old = as_flat_bits(old_bits)
    new = as_flat_bits(new_bits)
    if old.shape != new.shape:
        raise ValueError(f"shape mismatch: {old.shape} vs {new.shape}")
    if changes is None:
        changes = find_changes(old, new)
    return encode_changes(
        changes, int(new.size), overwrite_only=overwrite_only, positions=positions, values=values, dense_new=new
    )


def encode_changes(
    changes: Changes,
    numel: int,
    *,
    overwrite_only: bool = False,
    positions: str | None = None,
    values: str | None = None,
    dense_new: np.ndarray | None = None,
    run: Callable[[Sequence[Callable[[], Any]]], list[Any]] | None = None,
) -> EncodedDelta:
    """Smallest lossless coding of `changes` to a flat array of `numel` elements (see `encode_delta`).

    The ``dense`` coding carries every element, so it is only a candidate when `dense_new` (all
    new values) is given; without it, positions are always coded (a stream over many tensors).
    `run` runs a list of jobs and returns their results in order (a thread pool's map; default:
    one after the other here); the result does not depend on it.
    """
    if positions is not None and positions not in POSITION_CODECS[1:]:
        raise ValueError(f"positions must be one of {POSITION_CODECS[1:]}, got {positions!r}")
    if values is not None and values not in VALUE_CODECS:
        raise ValueError(f"values must be one of {VALUE_CODECS}, got {values!r}")
    if positions == "dense" and dense_new is None:
        raise ValueError("the dense coding needs every new value (dense_new)")
    new = dense_new
    count = changes.count
    if count == 0:
        return EncodedDelta(numel=numel, count=0)

    def wanted(codec: str) -> bool:
        return positions is None or positions == codec

    def value_options(old_v: np.ndarray, new_v: np.ndarray, bias: int) -> list[ValueCoding]:
        return _encode_values(old_v, new_v, values, overwrite_only, bias)

    # Candidates in order of decoding cost; on equal size the first (cheapest to decode) wins.
    candidates: list[EncodedDelta] = []
    # A quarter or more changed: carrying every element may be cheapest.
    if new is not None and wanted("dense") and (count * 4 >= numel or positions == "dense"):
        base = new.copy()  # the old values: new ones where nothing changed
        base[changes.positions] = changes.old
        for value in value_options(base, new, 0):
            candidates.append(_pack(numel, count, "dense", 0, [], value))
    # The values and the positions are coded independently: on two threads when `run` has them.
    sparse_values, sparse_positions = (run or _run_here)([
        lambda: value_options(changes.old, changes.new, 1),
        lambda: _position_codings(changes, numel, positions, sparse=count < numel or new is None),
    ])  # fmt: skip
    for codec, k, streams in sparse_positions:
        for value in sparse_values:
            candidates.append(_pack(numel, count, codec, k, streams, value))
    return min(candidates, key=lambda c: c.nbytes)


def _run_here(jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    return [job() for job in jobs]


# A position coding: codec, Rice k or Elias-Fano low bits, and its streams with whether each is
# worth compressing.
PositionCoding = tuple[str, int, list[tuple[bytes, bool]]]


def _position_codings(changes: Changes, numel: int, forced: str | None, sparse: bool) -> list[PositionCoding]:
    """Candidate codings of the changed positions (all but ``dense``), from size estimates first:
    Elias-Fano is cheapest both ways, so Rice (a pass over the gaps) is computed only when forced
    or when it should be clearly smaller. `sparse`: not every element changed, or there is no
    dense coding to carry them (a stream over many tensors always codes its positions)."""
    count = changes.count
    gap_sum = int(changes.positions[-1]) + 1 - count
    low_bits = best_ef_bits(count, numel)
    ef_bits = ef_cost_bits(count, numel, low_bits)
    rice_bits = estimate_rice_bits(count, gap_sum)
    options: list[PositionCoding] = []
    if forced in (None, "bitmask") and ((sparse and numel <= 1.05 * min(ef_bits, rice_bits)) or forced == "bitmask"):
        mask = np.zeros(numel, dtype=np.bool_)
        mask[changes.positions] = True
        options.append(("bitmask", 0, [(np.packbits(mask).tobytes(), True)]))
    if forced == "rice" or (forced is None and sparse and rice_bits < _RICE_OVER_EF * ef_bits):
        gaps = _gaps(changes.positions)
        k = best_rice_k(gaps)
        unary, low = rice_pack(gaps, k)
        options.append(("rice", k, [(unary, False), (low, False)]))
    elif forced == "ef" or (forced is None and sparse):
        upper, lower = ef_pack(changes.positions, low_bits)
        options.append(("ef", low_bits, [(upper, False), (lower, False)]))
    return options


def _stream(enc: EncodedDelta, index: int) -> bytes:
    return _unzip(enc.streams[index], enc.zipped[index], enc.raw_lengths[index])


def decode_positions(enc: EncodedDelta) -> np.ndarray:
    """Flat int64 positions of the changed elements (all of them for ``dense``)."""
    if enc.positions == "none":
        return np.zeros(0, dtype=np.int64)
    if enc.positions == "dense":
        return np.arange(enc.numel, dtype=np.int64)
    if enc.positions == "ef":
        positions = ef_unpack(_stream(enc, 0), _stream(enc, 1), enc.count, enc.rice_k)
    elif enc.positions == "rice":
        positions = rice_decode(_stream(enc, 0), _stream(enc, 1), enc.count, enc.rice_k)
    elif enc.positions == "bitmask":
        mask = np.frombuffer(_stream(enc, 0), dtype=np.uint8)
        if mask.size * 8 < enc.numel:
            raise DeltaFormatError(f"bitmask has {mask.size} bytes for {enc.numel} elements")
        positions = np.flatnonzero(np.unpackbits(mask, count=enc.numel).view(np.bool_))
    else:
        raise DeltaFormatError(f"unknown position codec {enc.positions!r}")
    if positions.size != enc.count or (positions.size and (positions[0] < 0 or positions[-1] >= enc.numel)):
        raise DeltaFormatError(f"decoded {positions.size} positions, expected {enc.count} within {enc.numel}")
    return positions


def decode_values(enc: EncodedDelta, old_at_positions: np.ndarray | None) -> np.ndarray:
    """New uint16 bit patterns for the positions `decode_positions` returns.

    `old_at_positions` (the base version's bits there) is needed for ``ulp`` / ``ulpr`` only.
    """
    if enc.positions == "none":
        return np.zeros(0, dtype=np.uint16)
    count = enc.numel if enc.positions == "dense" else enc.count
    first = _POSITION_STREAMS[enc.positions]
    streams = [_stream(enc, i) for i in range(first, len(enc.streams))]
    old = None if old_at_positions is None else as_flat_bits(old_at_positions)
    if old is not None and old.size != count:
        raise ValueError(f"{old.size} old values given for {count} positions")
    return _decode_values(enc, streams, old, count)


def needs_old_values(enc: EncodedDelta) -> bool:
    return enc.values != "raw"


def decode_delta(enc: EncodedDelta, old_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, new bit patterns) of a delta against the full flat `old_bits`."""
    old = as_flat_bits(old_bits)
    if old.size != enc.numel:
        raise ValueError(f"delta is for {enc.numel} elements, tensor has {old.size}")
    positions = decode_positions(enc)
    return positions, decode_values(enc, old[positions] if needs_old_values(enc) else None)


def apply_delta_bits(bits: np.ndarray, enc: EncodedDelta) -> None:
    """Apply a delta in place to a writable uint16/int16 numpy array of bit patterns."""
    flat = bits.reshape(-1).view(np.uint16)
    if flat.size and not np.shares_memory(flat, bits):
        raise ValueError("bits must be contiguous so the delta is applied in place")
    positions, values = decode_delta(enc, flat)
    flat[positions] = values
