"""Integer-sequence codes for sorted positions and small non-negative values: Rice (gap-coded,
a unary quotient stream plus k-bit remainders) and Elias-Fano (whole-byte low parts plus a unary
stream of the high parts). Sizes can be computed or estimated without coding, so a caller picks
the smaller code first and builds only that one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rljob.weights.bitfields import FAST_WIDTHS, WORD_TYPES, field_type, pack_fixed, unpack_fixed
from rljob.weights.errors import DeltaFormatError

# Whole bytes: the low parts need no bit packing. Bit-packed widths nearer log2(numel / count) would
# code 0.5-1% density about a bit per change smaller, at the cost of packing time for the publisher
# and a longer unary stream for the reader, on the path whose latency matters most.
_EF_LOW_BITS = (0, 8, 16)
# Values per block in Rice coding and in both decoders' arithmetic after the unary stream: a
# block's slices and reused buffers stay in L2, instead of three or four passes over int64 arrays
# the size of the changes (benchmarks/bench_weight_kernels.py).
_BLOCK = 1 << 16
# best_rice_k looks at about this many values (each candidate k costs a pass over them).
_RICE_K_SAMPLE = 1 << 18


def rice_cost_bits(values: np.ndarray, k: int) -> int:
    return int(values.size * (k + 1) + int(np.sum(values >> k)))


def best_rice_k(values: np.ndarray) -> int:
    """The Rice parameter that minimises the coded size, among widths `pack_fixed` packs fast.

    Searched next to log2 of the mean (where the optimum of a geometric distribution lies); the
    fast-width restriction costs at most a fraction of a bit.
    """
    if values.size == 0:
        return 0
    # Choosing k needs only the distribution: a strided sample.
    return _best_k_of_sample(values[:: _sample_stride(values.size)])


def best_rice_k_of_gaps(positions: np.ndarray) -> int:
    """`best_rice_k(position_gaps(positions))`, from the sampled gaps alone (no array of all gaps)."""
    if positions.size == 0:
        return 0
    picked = np.arange(0, positions.size, _sample_stride(positions.size))
    sample = positions[picked]
    sample[1:] -= positions[picked[1:] - 1] + 1
    return _best_k_of_sample(sample)


def _sample_stride(size: int) -> int:
    return size // _RICE_K_SAMPLE if size > _RICE_K_SAMPLE else 1


def _best_k_of_sample(values: np.ndarray) -> int:
    total = int(values.sum())
    # Capped at the widest fast width: gaps of 2^29 and more (a few changes in billions of values)
    # take it, with a short unary part, instead of finding no candidate at all.
    guess = min(max(0, int(np.log2(total / values.size * 0.69 + 1.0))), FAST_WIDTHS[-1])
    candidates = [k for k in FAST_WIDTHS if guess - 1 <= k <= guess + 2]

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
    guess = min(max(0, (gap_sum // count).bit_length() - 1), FAST_WIDTHS[-1])  # capped as in `_best_k_of_sample`
    return min(cost(k) for k in FAST_WIDTHS if guess - 3 <= k <= guess + 3)


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
    lower = positions.astype(WORD_TYPES[low_bits]).tobytes() if low_bits else b""  # the cast keeps the low bits
    return np.packbits(bits).tobytes(), lower


def ef_unpack(upper: bytes, lower: bytes, count: int, low_bits: int) -> np.ndarray:
    """Inverse of `ef_pack`: position i is (t_i - i) << low_bits | low_i, t_i the i-th set bit.

    Unlike Rice and bitmask positions, which increase by construction, low parts that do not
    increase within a high part decode to unsorted positions: checked block by block (in cache),
    because a reader splits positions by tensor assuming they are sorted."""
    if low_bits not in _EF_LOW_BITS:
        raise DeltaFormatError(f"Elias-Fano low parts of {low_bits} bits are not a supported width")
    positions = _terminators(upper, count)
    low = unpack_fixed(lower, count, low_bits, dtype=field_type(low_bits)) if low_bits else None
    ramp = np.arange(min(_BLOCK, count), dtype=np.int64)
    rising = np.empty(min(_BLOCK, count), dtype=np.bool_)
    for a in range(0, count, _BLOCK):
        b = min(a + _BLOCK, count)
        block = positions[a:b]
        block -= ramp[: b - a]
        block -= a
        if low is not None:
            block <<= low_bits
            block |= low[a:b]
        first = max(a, 1)  # each position above the one before it, across block boundaries too
        flags = rising[: b - first]
        np.greater(positions[first:b], positions[first - 1 : b - 1], out=flags)
        if not flags.all():
            raise DeltaFormatError("Elias-Fano positions are not increasing (a corrupt stream)")
    return positions


def rice_pack(values: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice-code non-negative integers of any integer dtype: (unary quotient bit stream, k-bit
    remainders)."""
    if values.size == 0:
        return b"", b""
    if values.dtype.kind == "i" and int(values.min()) < 0:
        raise ValueError("Rice coding takes non-negative integers")
    buffer = np.empty(min(_BLOCK, values.size), dtype=np.int64)

    def block_of(a: int, b: int) -> np.ndarray:
        if values.dtype == np.int64:
            return values[a:b]
        np.copyto(buffer[: b - a], values[a:b], casting="unsafe")  # exact for values below 2**63
        return buffer[: b - a]

    return _rice_pack_blocks(values.size, block_of, k, int(values.sum(dtype=np.int64)))


def _rice_pack_blocks(
    count: int, block_of: Callable[[int, int], np.ndarray], k: int, total: int
) -> tuple[bytes, bytes]:
    """Rice-code `count` values handed out in blocks by `block_of(a, b)` (int64, summing to
    `total`), with each block's terminators and remainders made in cache.

    The i-th terminator sits at sum_{j <= i} (quotient_j + 1) - 1: a running sum carried from
    block to block. Whole-array passes over int64 temporaries the size of the values made this
    the slowest step of publishing at 3-10% density (benchmarks/bench_weight_kernels.py).
    """
    bits = np.zeros((total >> k) + count, dtype=np.uint8)  # sum(v >> k) <= total >> k
    low = np.empty(count, dtype=field_type(k)) if k else None
    ends = np.empty(min(_BLOCK, count), dtype=np.int64)
    last = -1
    for a in range(0, count, _BLOCK):
        b = min(a + _BLOCK, count)
        values, terminators = block_of(a, b), ends[: b - a]
        np.right_shift(values, k, out=terminators)
        terminators += 1
        np.cumsum(terminators, out=terminators)
        terminators += last
        bits[terminators] = 1
        last = int(terminators[-1])
        if low is not None:
            np.bitwise_and(values, (1 << k) - 1, out=low[a:b], casting="unsafe")
    return np.packbits(bits[: last + 1]).tobytes(), pack_fixed(low, k) if low is not None else b""


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
    quotients |= unpack_fixed(low, count, k, dtype=field_type(k))
    return quotients


def position_gaps(positions: np.ndarray) -> np.ndarray:
    gaps = np.empty_like(positions)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def rice_encode(positions: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Gap-code strictly increasing positions: (unary quotient bit stream, k-bit remainders).

    The gaps are made a block at a time, never as one array."""
    count = positions.size
    if count == 0:
        return b"", b""
    buffer = np.empty(min(_BLOCK, count), dtype=np.int64)

    def gaps(a: int, b: int) -> np.ndarray:
        out = buffer[: b - a]
        if a == 0:
            out[0] = positions[0] + 1  # as if a change sat at -1
            np.subtract(positions[1:b], positions[: b - 1], out=out[1:])
        else:
            np.subtract(positions[a:b], positions[a - 1 : b - 1], out=out)
        out -= 1
        return out

    return _rice_pack_blocks(count, gaps, k, int(positions[-1]) + 1 - count)


def rice_decode(unary: bytes, low: bytes, count: int, k: int) -> np.ndarray:
    # The i-th terminator t_i sits at (sum of the first i+1 quotients) + i, so position i is
    # (t_i - i) * 2^k + i + (running sum of the remainders), which is
    # t_i * 2^k + (running sum of (remainder + 1 - 2^k)) + 2^k - 1: no ramp of i is materialised.
    terminators = _terminators(unary, count)
    if k == 0:
        return terminators
    # The remainders unpack as the narrowest integer that holds them (int8 for k <= 7: fewer bytes
    # per pass); the rest runs in blocks, the running sum carried from one block to the next.
    shifted = unpack_fixed(low, count, k, dtype=np.int8 if k <= 7 else np.int16 if k <= 15 else np.int32)
    shifted -= shifted.dtype.type((1 << k) - 1)
    running = np.empty(min(_BLOCK, count), dtype=np.int64)
    carry = (1 << k) - 1
    for a in range(0, count, _BLOCK):
        b = min(a + _BLOCK, count)
        block, total = terminators[a:b], running[: b - a]
        np.cumsum(shifted[a:b], dtype=np.int64, out=total)
        total += carry
        carry = int(total[-1])
        block <<= k
        block += total
    return terminators
