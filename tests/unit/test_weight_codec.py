"""Bit-exact round trips of the delta coding, on random and adversarial bf16 tensors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from rljob.weights.apply import apply_stream
from rljob.weights.changes import Changes, find_changes
from rljob.weights.checksum import bf16_bits, change_sum, tensor_checksum
from rljob.weights.codec import (
    DeltaFormatError,
    EncodedDelta,
    decode_positions,
    encode,
    from_ordered,
    to_ordered,
    ulp_unzigzag,
    ulp_zigzag,
)
from support.weight_codec import apply_delta_bits, decode, encode_delta

SHAPES = [(), (1,), (7,), (3, 5, 7), (1023,), (64, 33)]

NAN_QUIET, NAN_PAYLOAD, NEG_NAN = 0x7FC0, 0x7F81, 0xFFC1
POS_INF, NEG_INF, NEG_ZERO, POS_ZERO = 0x7F80, 0xFF80, 0x8000, 0x0000
SPECIALS = np.array(
    [
        NAN_QUIET,
        NAN_PAYLOAD,
        NEG_NAN,
        POS_INF,
        NEG_INF,
        NEG_ZERO,
        POS_ZERO,
        0x0001,
        0x8001,
        0x7F7F,
        0xFF7F,
        0x3F80,
        0xBF80,
    ],
    dtype=np.uint16,
)


def random_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    weights = torch.from_numpy(np.asarray(rng.standard_normal(shape) * 0.02, dtype=np.float32))
    return bf16_bits(weights).reshape(shape)


def nudge(rng: np.random.Generator, bits: np.ndarray, density: float, max_ulp: int = 2) -> np.ndarray:
    """Move a random `density` of the values by 1..max_ulp units in the last place."""
    out = bits.copy().reshape(-1)
    picked = rng.random(out.size) < density
    steps = rng.integers(1, max_ulp + 1, size=int(picked.sum())) * rng.choice([-1, 1], size=int(picked.sum()))
    ordered = to_ordered(out[picked]).astype(np.int32) + steps
    out[picked] = from_ordered(np.clip(ordered, -32768, 32767).astype(np.int16))
    return out.reshape(bits.shape)


def as_tensor(bits: np.ndarray, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).to(dtype)


def apply_one(target: torch.Tensor, enc: EncodedDelta) -> int:
    """The reader's apply (`apply_stream`) of a stream over this one tensor; its change sum."""
    return apply_stream([target], [target.numel()], enc)[0]


def roundtrip(old: np.ndarray, new: np.ndarray) -> EncodedDelta:
    enc = encode_delta(old, new)
    enc = EncodedDelta.from_meta(enc.meta(), enc.payload())  # through the wire format, as a reader sees it
    bits = old.copy()
    apply_delta_bits(bits, enc)
    assert bits.tobytes() == new.tobytes(), "not bit-exact"
    positions, values = decode(enc, old)
    changed = np.flatnonzero(old.reshape(-1) != new.reshape(-1))
    assert np.array_equal(positions, changed)
    assert np.array_equal(values, new.reshape(-1)[changed])
    assert enc.count == changed.size
    return enc


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("max_ulp", [2, 300])  # 300: steps beyond one byte (two step planes)
def test_random_changes_roundtrip(shape, density, max_ulp):
    rng = np.random.default_rng(zlib.crc32(repr((shape, density, max_ulp)).encode()))
    old = random_bits(rng, shape)
    roundtrip(old, nudge(rng, old, density, max_ulp=max_ulp))


def test_arbitrary_bit_patterns_roundtrip():
    """Uniformly random 16-bit patterns: NaNs, infinities, subnormals, both zeros, sign flips."""
    rng = np.random.default_rng(7)
    old = rng.integers(0, 2**16, size=4099, dtype=np.uint32).astype(np.uint16)
    new = old.copy()
    picked = rng.random(old.size) < 0.2
    new[picked] = rng.integers(0, 2**16, size=int(picked.sum()), dtype=np.uint32).astype(np.uint16)
    assert roundtrip(old, new).step_width == 2


def test_special_values_roundtrip():
    """Every transition between NaN payloads, +-inf, +-0 and extremes, in both directions."""
    old = np.repeat(SPECIALS, SPECIALS.size)
    new = np.tile(SPECIALS, SPECIALS.size)
    roundtrip(old, new)
    roundtrip(new, old)


@pytest.mark.parametrize("shape", SHAPES)
def test_none_changed_is_empty(shape):
    old = random_bits(np.random.default_rng(1), shape)
    enc = roundtrip(old, old.copy())
    assert len(enc.payload()) == 0 and enc.count == 0 and enc.streams == ()


@pytest.mark.parametrize("shape", SHAPES)
def test_all_changed_is_small(shape):
    """Every value one ulp up: gaps of 0 and steps of one, a fraction of a byte a change."""
    rng = np.random.default_rng(2)
    old = random_bits(rng, shape)
    new = from_ordered((to_ordered(old).astype(np.int32) + 1).clip(-32768, 32767).astype(np.int16))
    enc = roundtrip(old, new.reshape(old.shape))
    assert enc.count == old.size and enc.gap_width == enc.step_width == 1
    if old.size > 1000:
        assert len(enc.payload()) / enc.count < 0.05


def test_zero_dim_tensor_roundtrips_through_torch():
    for dtype in (torch.bfloat16, torch.float32):
        old = torch.tensor(1.5, dtype=dtype)
        new_bits = bf16_bits(torch.tensor(-0.0))
        apply_stream([old], [1], encode_delta(bf16_bits(old), new_bits))
        assert bf16_bits(old, exact=True).tobytes() == new_bits.tobytes()
        assert old.dim() == 0


def test_negative_zero_is_a_change():
    old = np.array([POS_ZERO, NEG_ZERO], dtype=np.uint16)
    new = np.array([NEG_ZERO, POS_ZERO], dtype=np.uint16)
    assert roundtrip(old, new).count == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_into_torch_in_place(dtype):
    """The apply writes into the tensor's own storage, exactly, for bf16 and fp32 targets."""
    rng = np.random.default_rng(3)
    old = random_bits(rng, (37, 29))
    old.reshape(-1)[: SPECIALS.size] = SPECIALS  # NaN payloads must survive an fp32 target too
    new = nudge(rng, old, 0.05)
    new.reshape(-1)[-SPECIALS.size :] = SPECIALS[::-1]
    target = as_tensor(old, dtype)
    target.requires_grad_(True)
    storage = target.untyped_storage().data_ptr()
    apply_one(target, encode_delta(old, new))
    assert target.untyped_storage().data_ptr() == storage
    assert bf16_bits(target, exact=True).tobytes() == new.tobytes()
    assert tensor_checksum(target) == tensor_checksum(as_tensor(new))


def test_fp32_masters_round_to_nearest_even():
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], dtype=torch.float32)
    bits = bf16_bits(values)
    assert list(bits) == [0x3F80, 0x3F82, 0x3F81]  # ties to even, above the tie rounds up


def test_small_updates_are_compact():
    """Sparse one-or-two-ulp changes, as small learning rates make: under 2 bytes a change (the
    plain coding of an int32 position and a bf16 value is 6)."""
    rng = np.random.default_rng(4)
    old = random_bits(rng, (1_000_000,))
    for density in (0.005, 0.01):
        enc = encode_delta(old, nudge(rng, old, density))
        assert enc.step_width == 1 and enc.gap_width in (1, 2)
        assert len(enc.payload()) / enc.count < 2.0


def test_ordered_mapping_is_a_bijection_and_ulp_steps_wrap_exactly():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ordered = to_ordered(every)
    assert np.unique(ordered).size == 2**16
    assert np.array_equal(from_ordered(ordered), every)
    # one ulp across zero: +min subnormal, +0, -0, -min subnormal are neighbours
    line = to_ordered(np.array([0x0001, 0x0000, 0x8000, 0x8001], dtype=np.uint16)).astype(np.int32)
    assert list(np.diff(line)) == [-1, -1, -1]
    shuffled = np.random.default_rng(9).permutation(every)
    step = to_ordered(shuffled).astype(np.int32) - to_ordered(every)
    step = (step + 2**15) % 2**16 - 2**15  # wrapped to 16 bits, in plain int32 arithmetic
    zig = ulp_zigzag(every, shuffled)
    assert np.array_equal(zig, (((step << 1) ^ (step >> 31)) & 0xFFFF).astype(np.uint16))
    assert np.array_equal(ulp_unzigzag(every, zig), shuffled)


def test_corrupt_streams_are_detected():
    rng = np.random.default_rng(10)
    old = random_bits(rng, (50_000,))
    enc = encode_delta(old, nudge(rng, old, 0.01))
    payload = bytearray(enc.payload())
    with pytest.raises(DeltaFormatError):
        EncodedDelta.from_meta(enc.meta(), bytes(payload[:-1]))
    for field, value in (("count", enc.count + 5), ("gap_width", 3), ("step_width", 4), ("numel", enc.count - 1)):
        with pytest.raises(DeltaFormatError):
            apply_delta_bits(old.copy(), EncodedDelta.from_meta(enc.meta() | {field: value}, bytes(payload)))
    broken = bytearray(payload)
    broken[len(enc.streams[0]) // 2] ^= 0xFF
    with pytest.raises(DeltaFormatError):
        apply_delta_bits(old.copy(), EncodedDelta.from_meta(enc.meta(), bytes(broken)))
    # A gap that runs past the end (a stream for fewer values than it claims).
    short = EncodedDelta.from_meta(enc.meta() | {"numel": int(decode_positions(enc)[-1])}, bytes(payload))
    with pytest.raises(DeltaFormatError, match="outside"):
        decode_positions(short)


def test_shape_and_dtype_mismatches_are_refused():
    old = np.zeros(10, dtype=np.uint16)
    with pytest.raises(ValueError):
        encode_delta(old, np.zeros(11, dtype=np.uint16))
    with pytest.raises(TypeError):
        encode_delta(old.astype(np.float32), old.astype(np.float32))
    enc = encode_delta(old, np.ones(10, dtype=np.uint16))
    with pytest.raises(TypeError):
        apply_one(torch.zeros(10, dtype=torch.float16), enc)
    with pytest.raises(DeltaFormatError):
        apply_one(torch.zeros(11, dtype=torch.bfloat16), enc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_returns_the_publishers_change_sum(dtype):
    """The reader's sum over what its target held and now holds equals the publisher's sum."""
    rng = np.random.default_rng(11)
    old = random_bits(rng, (41, 23))
    new = nudge(rng, old, 0.3)
    new.reshape(-1)[:3] = [NAN_PAYLOAD, NEG_ZERO, POS_INF]
    changes = find_changes(old, new)
    expected = change_sum(changes.positions, changes.old, changes.new)
    target = as_tensor(old, dtype)
    assert apply_one(target, encode_delta(old, new)) == expected
    assert bf16_bits(target, exact=True).tobytes() == new.tobytes()


def test_change_sum_exposes_a_target_off_its_base_where_the_delta_touches():
    rng = np.random.default_rng(12)
    old = random_bits(rng, (5000,))
    new = nudge(rng, old, 0.05)
    changes = find_changes(old, new)
    expected = change_sum(changes.positions, changes.old, changes.new)
    drifted = old.copy()
    drifted[changes.positions[7]] ^= 0x0001  # one touched value is not what the base version had
    assert apply_one(as_tensor(drifted), encode_delta(old, new)) != expected


def test_change_sum_is_position_aware_and_zero_for_no_change():
    positions = np.array([3, 9], dtype=np.int64)
    a, b = np.array([1, 2], dtype=np.uint16), np.array([2, 1], dtype=np.uint16)
    assert change_sum(positions, a, b) != change_sum(positions[::-1].copy(), a, b)
    assert change_sum(positions, a, a) == 0
    assert change_sum(positions[:0], a[:0], b[:0]) == 0


@pytest.mark.parametrize("size", [1, 5, 4096, (1 << 20) * 2 + 13])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.1, 0.3, 1.0])  # word-wise below ~15%, value-wise above
@pytest.mark.parametrize("offset", [0, 1])  # 1: arrays that do not start on an 8-byte boundary
def test_find_changes_matches_a_plain_compare_and_advances_in_place(size, density, offset):
    rng = np.random.default_rng(size)
    old = rng.integers(0, 2**16, size=size + offset, dtype=np.uint32).astype(np.uint16)[offset:]
    new = old.copy()
    picked = rng.random(size) < density
    new[picked] ^= rng.integers(1, 2**16, size=int(picked.sum()), dtype=np.uint32).astype(np.uint16)
    changes = find_changes(old, new)
    expected = np.flatnonzero(old != new)
    assert np.array_equal(changes.positions, expected)
    assert np.array_equal(changes.old, old[expected]) and np.array_equal(changes.new, new[expected])
    base = np.zeros(size + offset, dtype=np.uint16)[offset:]
    base[:] = old
    advanced = find_changes(base, new, advance=True)
    assert np.array_equal(advanced.positions, expected) and np.array_equal(advanced.old, old[expected])
    assert np.array_equal(base, new)


def test_change_sum_keeps_its_definition():
    """The sum is a contract between publisher and reader: check it against the formula in plain
    Python integers."""
    from rljob.weights.checksum import _VALUE_HASH

    rng = np.random.default_rng(5)
    positions = np.sort(rng.choice(1 << 40, size=1000, replace=False)).astype(np.int64)
    old = rng.integers(0, 2**16, size=1000, dtype=np.uint32).astype(np.uint16)
    new = rng.integers(0, 2**16, size=1000, dtype=np.uint32).astype(np.uint16)
    table = [int(v) for v in _VALUE_HASH]
    reference = sum((2 * int(p) + 1) * (table[n] - table[o]) for p, o, n in zip(positions, old, new, strict=True))
    assert change_sum(positions, old, new) == reference % 2**64
    small = positions >> 12  # < 2**31: the same sum from int32 positions
    assert change_sum(small.astype(np.int32), old, new) == change_sum(small, old, new)


@pytest.mark.parametrize("block", [1 << 16, 32, 7, 1])
def test_change_sum_does_not_depend_on_its_block_size(block, monkeypatch):
    """Blocks that cut anywhere (one change each, a few, all) give the definition's sum."""
    from rljob.weights import checksum

    rng = np.random.default_rng(6)
    positions = np.sort(rng.choice(10_000, size=353, replace=False)).astype(np.int64)
    old = rng.integers(0, 2**16, size=positions.size, dtype=np.uint32).astype(np.uint16)
    new = rng.integers(0, 2**16, size=positions.size, dtype=np.uint32).astype(np.uint16)
    table = [int(v) for v in checksum._VALUE_HASH]
    reference = sum((2 * int(p) + 1) * (table[n] - table[o]) for p, o, n in zip(positions, old, new, strict=True))
    monkeypatch.setattr(checksum, "_SUM_BLOCK", block)
    assert change_sum(positions, old, new) == reference % 2**64
    assert change_sum(positions[:0], old[:0], new[:0]) == 0


def test_wide_steps_are_coded_in_two_planes_and_roundtrip():
    """Old values and new ones moved by heavy-tailed ulp steps, as a first AdamW step moves small
    weights: two step planes, still under 2 bytes a change."""
    rng = np.random.default_rng(21)
    old = bf16_bits(torch.from_numpy(rng.standard_normal(400_000).astype(np.float32) * 0.02)).copy()
    steps = np.maximum(1, np.minimum(rng.lognormal(1.0, 1.5, old.size), 30000)).astype(np.int32)
    new = from_ordered(
        (to_ordered(old).astype(np.int32) + steps * rng.choice([-1, 1], old.size)).clip(-32768, 32767).astype(np.int16)
    )
    enc = roundtrip(old, new)
    assert enc.step_width == 2 and len(enc.payload()) / enc.count < 2.0


@pytest.mark.parametrize(
    ("numel", "positions"), [(3_000_000_000, [1_700_000_000]), (20_000_000_000, [5, 3_000_000_000, 19_999_999_999])]
)
def test_a_few_changes_in_billions_of_values_are_coded(numel, positions):
    """Gaps past 2^32 take 8-byte planes. The changes alone are coded; no model of that size is made."""
    where = np.array(positions, dtype=np.int64)
    changes = Changes(where, np.ones(where.size, dtype=np.uint16), np.full(where.size, 2, dtype=np.uint16))
    enc = encode(changes, numel)
    assert enc.gap_width == (4 if np.diff(where, prepend=-1).max() <= 2**32 else 8)
    assert np.array_equal(decode_positions(EncodedDelta.from_meta(enc.meta(), enc.payload())), where)
    with pytest.raises(ValueError, match="outside"):
        encode(changes, positions[-1])
