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
size against level 6). The zlib is zlib-ng's (the `zlib-ng` package): the same stream format, read
by any zlib, 1.7x the system zlib's speed to deflate these planes and 1.4x to inflate them
(benchmarks/bench_weight_kernels.py); a reader inflates on the path whose speed is a target.

Speed: encoding and decoding are a fixed, small number of numpy passes over the *changed* values.
The only pass over all values is `rljob.weights.changes.find_changes`, which compares in
cache-sized blocks. The integer codes (Rice, Elias-Fano) live in `intcodes`, the bit packing in
`bitfields`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zlib_ng import zlib_ng

from rljob.weights.bitfields import pack_fixed, unpack_fixed
from rljob.weights.changes import Changes, as_flat_bits, find_changes
from rljob.weights.errors import DeltaFormatError
from rljob.weights.intcodes import (
    best_ef_bits,
    best_rice_k,
    best_rice_k_of_gaps,
    ef_cost_bits,
    ef_pack,
    ef_unpack,
    estimate_rice_bits,
    rice_cost_bits,
    rice_decode,
    rice_encode,
    rice_pack,
    rice_unpack,
)

POSITION_CODECS = ("none", "rice", "bitmask", "dense", "ef")
VALUE_CODECS = ("raw", "ulp", "ulpr", "ulpf")
_POSITION_STREAMS = {"none": 0, "rice": 2, "bitmask": 1, "dense": 0, "ef": 2}
_VALUE_STREAMS = {"raw": 1, "ulp": 1, "ulpr": 2, "ulpf": 1}
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
# Values per block in `ulp_unzigzag` (its two int16 buffers stay in L1/L2).
_ULP_BLOCK = 1 << 16


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


def _int16_blocks(count: int) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """Blocks of `_ULP_BLOCK` values for the ulp kernels: each block's slice and two int16
    scratch arrays of its length, reused from block to block, so the in-place ufuncs of a block
    stay in L1/L2 instead of making a fresh temporary the size of the changes per operation."""
    first, second = np.empty(min(_ULP_BLOCK, count), dtype=np.int16), np.empty(min(_ULP_BLOCK, count), np.int16)
    for a in range(0, count, _ULP_BLOCK):
        b = min(a + _ULP_BLOCK, count)
        yield slice(a, b), first[: b - a], second[: b - a]


def ulp_zigzag(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Signed ulp steps old -> new (wrapping mod 2^16, so exact for every pattern), zig-zag coded.

    The arithmetic of `to_ordered`, in blocks (`_int16_blocks`): 2.2-2.3x the whole-array
    expressions at 10% density (benchmarks/bench_weight_kernels.py).
    """
    old_s = np.ascontiguousarray(old).reshape(-1).view(np.int16)
    new_s = np.ascontiguousarray(new).reshape(-1).view(np.int16)
    out = np.empty(old_s.size, dtype=np.uint16)
    magnitude, result = np.int16(0x7FFF), out.view(np.int16)
    for block, step, sign in _int16_blocks(old_s.size):
        o, n, r = old_s[block], new_s[block], result[block]
        np.right_shift(n, 15, out=sign)  # step = to_ordered(new) - to_ordered(old)
        sign &= magnitude
        np.bitwise_xor(n, sign, out=step)
        np.right_shift(o, 15, out=sign)
        sign &= magnitude
        sign ^= o
        step -= sign
        np.left_shift(step, 1, out=r)  # r = (step << 1) ^ (step >> 15)
        step >>= 15
        r ^= step
    return out


def ulp_unzigzag(old: np.ndarray, zig: np.ndarray) -> np.ndarray:
    """Inverse of `ulp_zigzag`: new patterns from the old ones and the zig-zag steps.

    The arithmetic of `to_ordered` / `from_ordered`, in blocks (`_int16_blocks`): 2.0-3.0x the
    whole-array expressions at 10% density (benchmarks/bench_weight_kernels.py), whose dozen
    fresh temporaries each cost a pass through memory and its page faults.
    """
    old_s = np.ascontiguousarray(old).reshape(-1).view(np.int16)
    zig_u = np.ascontiguousarray(zig, dtype=np.uint16).reshape(-1)
    out = np.empty(old_s.size, dtype=np.uint16)
    magnitude, result = np.int16(0x7FFF), out.view(np.int16)
    for block, step, sign in _int16_blocks(old_s.size):
        z, o, r = zig_u[block], old_s[block], result[block]
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
    compressor = zlib_ng.compressobj(_ZLIB_LEVEL, zlib_ng.DEFLATED, 15, 9, zlib_ng.Z_RLE)
    packed = compressor.compress(stream) + compressor.flush()
    if len(packed) <= len(stream) * (1.0 - _MIN_ZLIB_SAVING):
        return packed, True
    return stream, False


def _unzip(stream: bytes, zipped: bool, raw_length: int) -> bytes:
    if not zipped:
        return stream
    try:
        out = zlib_ng.decompress(stream)
    except zlib_ng.error as exc:
        raise DeltaFormatError(f"corrupt compressed stream: {exc}") from exc
    if len(out) != raw_length:
        raise DeltaFormatError(f"stream inflated to {len(out)} bytes, expected {raw_length}")
    return out


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
        return [_byte_coding(zig)]
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
            return ("ulpr", k, list(rice_pack(steps, k)), [False, False])

        coded_bytes = (rice_bits + 7) // 8 + 1  # two streams, each rounded up to whole bytes
    if forced is not None or width <= 4:
        return [coded()]
    # Wide steps (real optimizer updates move small weights by many ulp): the byte coding with
    # zlib, or a plain overwrite when steps are huge, can be smaller.
    byte_coded = _byte_coding(zig)
    options: list[tuple[Callable[[], ValueCoding], int | None]] = [
        (coded, coded_bytes),
        (lambda: byte_coded, _zipped_size_estimate(byte_coded[2][0])),
    ]
    if top >= _ULP_RAW_THRESHOLD:
        overwrite = raw()
        options.append((lambda: overwrite, _zipped_size_estimate(overwrite[2][0])))
    return _near_smallest(options)


def _byte_coding(zig: np.ndarray) -> ValueCoding:
    """The ``ulp`` coding: zig-zag steps as whole bytes (one per value when all fit, else two byte
    planes), for zlib to compress."""
    if zig.size and int(zig.max()) < 256:
        return ("ulp", 1, [zig.astype(np.uint8).tobytes()], [True])
    return ("ulp", 2, [_split_planes(zig)], [True])


def _near_smallest(options: list[tuple[Callable[[], ValueCoding], int | None]]) -> list[ValueCoding]:
    """Build only the candidates whose size (exact, or a sampled estimate for zlib streams) is
    within `_KEEP_WITHIN` of the smallest; the caller compresses them and keeps the smallest. On
    the first AdamW step of SmolLM2 the zipped byte coding is 4-7x smaller than the Rice-coded steps
    and the zipped overwrite, so those two are never packed nor compressed. A size of None (a
    stream too small to sample) builds them all: they are cheap, and sizing one would compress it
    twice."""
    if any(size is None for _, size in options):
        return [build() for build, _ in options]
    smallest = min(size for _, size in options if size is not None)
    return [build() for build, size in options if size is not None and size <= _KEEP_WITHIN * smallest]


def _zipped_size_estimate(stream: bytes) -> int | None:
    """Size of `stream` after `_maybe_zip`, scaled from `_ZIP_SAMPLES` evenly spaced pieces of
    `_ZIP_SAMPLE_BYTES`, which cover both byte planes (tests/unit/test_weight_encoding.py holds it
    within 5% on AdamW-like steps); None for a stream too small for sampling to save anything."""
    n = len(stream)
    if n <= 2 * _ZIP_SAMPLES * _ZIP_SAMPLE_BYTES:
        return None
    starts = np.linspace(0, n - _ZIP_SAMPLE_BYTES, _ZIP_SAMPLES).astype(np.int64)
    sampled = sum(len(_maybe_zip(stream[a : a + _ZIP_SAMPLE_BYTES])[0]) for a in starts)
    return min(n, int(sampled / (_ZIP_SAMPLES * _ZIP_SAMPLE_BYTES) * n))


def _value_codes(enc: EncodedDelta, streams: list[bytes], count: int) -> tuple[bool, np.ndarray]:
    """The value streams decoded as far as they go without the old values: (False, new patterns)
    for ``raw``; (True, zig-zag ulp steps, to apply with `ulp_unzigzag`) for the ulp codings."""
    if enc.values == "raw":
        return False, _join_planes(streams[0], count)
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
        return True, steps
    if enc.value_width == 1:
        zig = np.frombuffer(streams[0], dtype=np.uint8)
        if zig.size != count:
            raise DeltaFormatError(f"value stream has {zig.size} bytes, expected {count}")
        return True, zig
    return True, _join_planes(streams[0], count)


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
        k = best_rice_k_of_gaps(changes.positions)
        unary, low = rice_encode(changes.positions, k)
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
    old = None if old_at_positions is None else as_flat_bits(old_at_positions)
    if old is not None and old.size != count:
        raise ValueError(f"{old.size} old values given for {count} positions")
    if needs_old_values(enc) and old is None:
        raise ValueError("ulp-coded values need the old bit patterns at the changed positions")
    return patterns_from_codes(*decode_value_codes(enc), old)


def patterns_from_codes(steps: bool, codes: np.ndarray, old: np.ndarray | None) -> np.ndarray:
    """New uint16 patterns from `decode_value_codes`' result and the old patterns at the same
    positions (read only for ulp steps, so None will do for raw patterns)."""
    if not steps:
        return codes.view(np.uint16)
    assert old is not None, "ulp steps need the old patterns"
    return ulp_unzigzag(old, codes)


def decode_value_codes(enc: EncodedDelta) -> tuple[bool, np.ndarray]:
    """`decode_values` short of the old values: (False, new patterns) or (True, zig-zag ulp steps,
    to apply with `patterns_from_codes`) for the positions `decode_positions` returns, for an apply
    that reads the old values itself."""
    if enc.positions == "none":
        return False, np.zeros(0, dtype=np.uint16)
    count = enc.numel if enc.positions == "dense" else enc.count
    first = _POSITION_STREAMS[enc.positions]
    return _value_codes(enc, [_stream(enc, i) for i in range(first, len(enc.streams))], count)


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
