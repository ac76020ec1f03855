"""The one lossless coding of a version's change, on bf16 bit patterns.

A change is *where* values differ and *what* they are now. Where: the gaps between consecutive
changed positions. What: each value's signed step from its old value in units in the last place
(ulp) on the ordered bf16 number line, zig-zag coded. Each becomes little-endian byte planes of
the smallest width that holds it, deflated with zlib's run-length strategy (zlib-ng's, read by
any zlib). Small-learning-rate updates move most values by one or two ulp and gaps are short
and skewed, so the planes are mostly small or zero bytes. The ablation that chose this coding
over the twelve it replaced is docs/results/weight_codec.md.

Exact for every bit pattern: a step is an integer mod 2^16, so NaN, infinity and -0 round-trip.
A step needs the old value, so the reader must hold exactly the base version; its change sum
(`checksum.change_sum`) checks that wherever the delta touches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from zlib_ng import zlib_ng

from rljob.weights.changes import Changes
from rljob.weights.parallel import TensorPool

WIDTHS = (1, 2, 4, 8)


class DeltaFormatError(ValueError):
    """An encoded delta is malformed (truncated stream, wrong sizes, positions out of range)."""


@dataclass(frozen=True)
class EncodedDelta:
    """The change of `numel` flat bf16 values, `count` of which changed: two deflated streams
    (gaps, then zig-zag steps minus one), none when nothing changed."""

    numel: int
    count: int
    gap_width: int = 1
    step_width: int = 1
    streams: tuple[bytes, ...] = ()

    def payload(self) -> bytes:
        return b"".join(self.streams)

    def meta(self) -> dict[str, Any]:
        """Everything but the payload, for the manifest."""
        return {
            "numel": self.numel,
            "count": self.count,
            "gap_width": self.gap_width,
            "step_width": self.step_width,
            "lengths": [len(s) for s in self.streams],
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], payload: bytes | memoryview) -> EncodedDelta:
        lengths = [int(n) for n in meta["lengths"]]
        count, numel = int(meta["count"]), int(meta["numel"])
        if sum(lengths) != len(payload) or len(lengths) != (2 if count else 0):
            raise DeltaFormatError(f"payload of {len(payload)} bytes does not match stream lengths {lengths}")
        if meta["gap_width"] not in WIDTHS or meta["step_width"] not in WIDTHS[:2] or not 0 <= count <= numel:
            raise DeltaFormatError(f"invalid delta stream {meta}")
        view, streams, offset = memoryview(payload), [], 0
        for n in lengths:
            streams.append(bytes(view[offset : offset + n]))
            offset += n
        return cls(numel, count, int(meta["gap_width"]), int(meta["step_width"]), tuple(streams))


def to_ordered(bits: np.ndarray) -> np.ndarray:
    """Map bf16 bit patterns onto an int16 number line where adjacent floats differ by one.

    Bijective and self-inverse: non-negative patterns keep their value; for negative ones the 15
    magnitude bits are flipped, so -0 -> -1 and one ulp either side of zero is one step.
    """
    signed = np.ascontiguousarray(bits).view(np.int16)
    return signed ^ ((signed >> 15) & np.int16(0x7FFF))


def from_ordered(ordered: np.ndarray) -> np.ndarray:
    return to_ordered(ordered).view(np.uint16)


def ulp_zigzag(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Signed ulp steps old -> new (wrapping mod 2^16), zig-zag coded, as uint16."""
    step = to_ordered(np.ravel(new)) - to_ordered(np.ravel(old))
    return ((step << 1) ^ (step >> 15)).view(np.uint16)


def ulp_unzigzag(old: np.ndarray, zig: np.ndarray) -> np.ndarray:
    """Inverse of `ulp_zigzag`: the new patterns from the old ones and the zig-zag steps."""
    zig = np.ravel(zig).astype(np.uint16, copy=False)
    step = (zig >> 1).view(np.int16) ^ -(zig & 1).view(np.int16)
    return from_ordered(to_ordered(np.ravel(old)) + step)


def _width(top: int) -> int:
    return next(w for w in WIDTHS if top < 1 << (8 * w))


def _deflated_planes(values: np.ndarray, width: int) -> bytes:
    """Low bytes first, then the next plane up: the high planes are mostly zero runs."""
    planes = values.astype(f"<u{width}").view(np.uint8).reshape(-1, width).T.tobytes()
    packer = zlib_ng.compressobj(1, zlib_ng.DEFLATED, 15, 9, zlib_ng.Z_RLE)
    return packer.compress(planes) + packer.flush()


def _inflated_planes(stream: bytes, count: int, width: int, dtype: type[np.integer]) -> np.ndarray:
    try:
        raw = zlib_ng.decompress(stream)
    except zlib_ng.error as exc:
        raise DeltaFormatError(f"corrupt delta stream: {exc}") from exc
    if len(raw) != count * width:
        raise DeltaFormatError(f"delta stream inflated to {len(raw)} bytes, expected {count * width}")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, count)
    out = np.zeros(count, dtype=np.dtype(dtype).newbyteorder("<"))
    if width > out.itemsize:
        raise DeltaFormatError(f"{width}-byte values do not fit {out.dtype}")
    lanes = out.view(np.uint8).reshape(count, out.itemsize)
    for i in range(width):  # one strided copy per plane
        lanes[:, i] = planes[i]
    return out


def encode(changes: Changes, numel: int, pool: TensorPool | None = None) -> EncodedDelta:
    """The coding of `changes` to a flat array of `numel` values. The two streams are coded side by
    side on `pool` (zlib releases the GIL); the result does not depend on it."""
    if changes.count == 0:
        return EncodedDelta(numel, 0)
    if int(changes.positions[-1]) >= numel:
        raise ValueError(f"a change at {int(changes.positions[-1])} is outside {numel} values")

    def gaps() -> tuple[int, bytes]:
        gap = np.diff(changes.positions, prepend=-1)
        gap -= 1
        width = _width(int(gap.max()))
        return width, _deflated_planes(gap, width)

    def steps() -> tuple[int, bytes]:
        step = ulp_zigzag(changes.old, changes.new)
        step -= np.uint16(1)  # a changed value never steps by 0
        width = _width(int(step.max()))
        return width, _deflated_planes(step, width)

    (gap_width, gap_stream), (step_width, step_stream) = (pool or TensorPool(1)).map(lambda job: job(), [gaps, steps])
    return EncodedDelta(numel, changes.count, gap_width, step_width, (gap_stream, step_stream))


def decode_positions(enc: EncodedDelta) -> np.ndarray:
    """Flat int64 positions of the changed values, strictly increasing, checked to lie inside."""
    if enc.count == 0:
        return np.zeros(0, dtype=np.int64)
    positions = _inflated_planes(enc.streams[0], enc.count, enc.gap_width, np.int64)
    if int(positions.max()) >= enc.numel:
        raise DeltaFormatError(f"a gap outside the stream's {enc.numel} values")
    positions += 1
    np.cumsum(positions, out=positions)
    positions -= 1
    if int(positions[-1]) >= enc.numel:
        raise DeltaFormatError(f"decoded position {int(positions[-1])} outside {enc.numel} values")
    return positions


def decode_steps(enc: EncodedDelta) -> np.ndarray:
    """The zig-zag ulp steps of the changed values, for `ulp_unzigzag` with their old patterns."""
    if enc.count == 0:
        return np.zeros(0, dtype=np.uint16)
    steps = _inflated_planes(enc.streams[1], enc.count, enc.step_width, np.uint16)
    steps += np.uint16(1)
    return steps
