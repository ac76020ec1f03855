"""Bit-exact round trips of every delta encoding, on random and adversarial bf16 tensors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from rljob.weights import encoding, intcodes
from rljob.weights.apply import apply_delta
from rljob.weights.bitfields import pack_fixed, unpack_fixed
from rljob.weights.changes import find_changes
from rljob.weights.checksum import bf16_bits, change_sum, tensor_checksum
from rljob.weights.encoding import (
    DeltaFormatError,
    EncodedDelta,
    apply_delta_bits,
    decode_delta,
    encode_changes,
    encode_delta,
    from_ordered,
    to_ordered,
    ulp_unzigzag,
    ulp_zigzag,
)
from rljob.weights.intcodes import (
    best_rice_k,
    best_rice_k_of_gaps,
    ef_pack,
    ef_unpack,
    position_gaps,
    rice_decode,
    rice_encode,
    rice_pack,
    rice_unpack,
)

CODECS = [(p, v) for p in ("ef", "rice", "bitmask", "dense") for v in ("raw", "ulp", "ulpr", "ulpf")]
SHAPES = [(), (1,), (7,), (3, 5, 7), (1023,), (64, 33)]

NAN_QUIET, NAN_PAYLOAD, NEG_NAN = 0x7FC0, 0x7F81, 0xFFC1
POS_INF, NEG_INF, NEG_ZERO, POS_ZERO = 0x7F80, 0xFF80, 0x8000, 0x0000
SPECIALS = np.array([NAN_QUIET, NAN_PAYLOAD, NEG_NAN, POS_INF, NEG_INF, NEG_ZERO, POS_ZERO, 0x0001, 0x8001,
                     0x7F7F, 0xFF7F, 0x3F80, 0xBF80], dtype=np.uint16)  # fmt: skip


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


def roundtrip(old: np.ndarray, new: np.ndarray, **force: str) -> EncodedDelta:
    enc = encode_delta(old, new, **force)
    # Through the wire format, as the reader sees it.
    enc = EncodedDelta.from_meta(enc.meta(), enc.payload())
    bits = old.copy()
    apply_delta_bits(bits, enc)
    assert bits.tobytes() == new.tobytes(), f"{enc.encoding} is not bit-exact"
    positions, values = decode_delta(enc, old)
    changed = np.flatnonzero(old.reshape(-1) != new.reshape(-1))
    if enc.positions == "dense":
        assert positions.size == old.size
    else:
        assert np.array_equal(positions, changed)
        assert np.array_equal(values, new.reshape(-1)[changed])
    assert enc.count == changed.size
    return enc


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("positions", "values"), CODECS)
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
def test_every_codec_roundtrips_random_changes(shape, positions, values, density):
    rng = np.random.default_rng(zlib.crc32(repr((shape, positions, values, density)).encode()))
    old = random_bits(rng, shape)
    new = nudge(rng, old, density, max_ulp=300)  # beyond one byte: exercises 2-byte ulp values too
    enc = roundtrip(old, new, positions=positions, values=values)
    if enc.count:
        assert (enc.positions, enc.values) == (positions, values)


@pytest.mark.parametrize(("positions", "values"), CODECS)
def test_every_codec_roundtrips_arbitrary_bit_patterns(positions, values):
    """Uniformly random 16-bit patterns: NaNs, infinities, subnormals, both zeros, sign flips."""
    rng = np.random.default_rng(7)
    old = rng.integers(0, 2**16, size=4099, dtype=np.uint32).astype(np.uint16)
    new = old.copy()
    picked = rng.random(old.size) < 0.2
    new[picked] = rng.integers(0, 2**16, size=int(picked.sum()), dtype=np.uint32).astype(np.uint16)
    roundtrip(old, new, positions=positions, values=values)


@pytest.mark.parametrize(("positions", "values"), CODECS)
def test_special_values_roundtrip(positions, values):
    """Every transition between NaN payloads, +-inf, +-0 and extremes, in both directions."""
    old = np.repeat(SPECIALS, SPECIALS.size)
    new = np.tile(SPECIALS, SPECIALS.size)
    roundtrip(old, new, positions=positions, values=values)
    roundtrip(new, old, positions=positions, values=values)


@pytest.mark.parametrize("shape", SHAPES)
def test_none_changed_is_empty(shape):
    old = random_bits(np.random.default_rng(1), shape)
    enc = roundtrip(old, old.copy())
    assert enc.positions == "none" and enc.nbytes == 0 and enc.count == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_all_changed_chooses_dense(shape):
    rng = np.random.default_rng(2)
    old = random_bits(rng, shape)
    new = from_ordered((to_ordered(old).astype(np.int32) + 1).clip(-32768, 32767).astype(np.int16))
    enc = roundtrip(old, new.reshape(old.shape))
    assert enc.count == old.size
    assert enc.positions == "dense"


def test_zero_dim_tensor_roundtrips_through_torch():
    for dtype in (torch.bfloat16, torch.float32):
        old = torch.tensor(1.5, dtype=dtype)
        new_bits = bf16_bits(torch.tensor(-0.0))
        enc = encode_delta(bf16_bits(old), new_bits)
        apply_delta(old, enc)
        assert bf16_bits(old, exact=True).tobytes() == new_bits.tobytes()
        assert old.dim() == 0


def test_negative_zero_is_a_change():
    old = np.array([POS_ZERO, NEG_ZERO], dtype=np.uint16)
    new = np.array([NEG_ZERO, POS_ZERO], dtype=np.uint16)
    enc = roundtrip(old, new)
    assert enc.count == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("positions", "values"), CODECS)
def test_apply_into_torch_in_place(dtype, positions, values):
    """apply_delta writes into the tensor's own storage, exactly, for bf16 and fp32 targets."""
    rng = np.random.default_rng(3)
    old = random_bits(rng, (37, 29))
    old.reshape(-1)[: SPECIALS.size] = SPECIALS  # NaN payloads must survive an fp32 target too
    new = nudge(rng, old, 0.05)
    new.reshape(-1)[-SPECIALS.size :] = SPECIALS[::-1]
    target = torch.from_numpy(old.view(np.int16).copy()).view(torch.bfloat16).to(dtype)
    target.requires_grad_(True)
    storage = target.untyped_storage().data_ptr()
    apply_delta(target, encode_delta(old, new, positions=positions, values=values))
    assert target.untyped_storage().data_ptr() == storage
    assert bf16_bits(target, exact=True).tobytes() == new.tobytes()
    assert tensor_checksum(target) == tensor_checksum(torch.from_numpy(new.view(np.int16)).view(torch.bfloat16))


def test_fp32_masters_round_to_nearest_even():
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], dtype=torch.float32)
    bits = bf16_bits(values)
    assert list(bits) == [0x3F80, 0x3F82, 0x3F81]  # ties to even, above the tie rounds up


def test_small_updates_are_compact():
    """Sparse one-or-two-ulp changes, as small learning rates make: well under 6 bytes a change."""
    rng = np.random.default_rng(4)
    old = random_bits(rng, (1_000_000,))
    for density in (0.005, 0.01):
        enc = encode_delta(old, nudge(rng, old, density))
        assert enc.positions == "ef" and enc.values in ("ulpf", "ulpr")
        assert enc.nbytes / enc.count < 2.0
        overwrite = encode_delta(old, nudge(rng, old, density), overwrite_only=True)
        assert overwrite.values == "raw"
        assert overwrite.nbytes / overwrite.count < 3.5


def test_dense_changes_use_bitmask_or_dense():
    rng = np.random.default_rng(5)
    old = random_bits(rng, (200_000,))
    enc = encode_delta(old, nudge(rng, old, 0.6))
    assert enc.positions in ("bitmask", "dense")


def test_compression_is_used_only_where_it_pays():
    rng = np.random.default_rng(6)
    old = random_bits(rng, (200_000,))
    compressible = encode_delta(old, nudge(rng, old, 0.01), values="raw")
    assert compressible.zipped[-1]  # the sign/exponent plane compresses
    noise = rng.integers(0, 2**16, size=old.size, dtype=np.uint32).astype(np.uint16)
    incompressible = encode_delta(old, noise, positions="dense", values="raw")
    assert incompressible.zipped == (False,)


@pytest.mark.parametrize("bits", range(1, 33))
@pytest.mark.parametrize("size", [1, 7, 1001])
def test_fixed_width_packing(bits, size):
    """Every width, group-packed or word-packed, against a plain bit-by-bit reference."""
    rng = np.random.default_rng(bits * 10_000 + size)
    values = rng.integers(0, 2**bits, size=size, dtype=np.uint64).astype(np.int64)
    values[0] = 2**bits - 1
    packed = pack_fixed(values, bits)
    reference = np.packbits(((values[:, None] >> np.arange(bits - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1))
    assert packed == reference.tobytes()
    assert np.array_equal(unpack_fixed(packed, values.size, bits), values)


@pytest.mark.parametrize("block", [1 << 16, 1000, 7])
def test_rice_coding_of_positions(block, monkeypatch):
    monkeypatch.setattr(intcodes, "_BLOCK", block)  # the running sum carried across blocks
    rng = np.random.default_rng(8)
    positions = np.flatnonzero(rng.random(100_000) < 0.02)
    for k in range(0, 17):  # int8, int16 and int32 remainders on the way back
        unary, low = rice_encode(positions, k)
        assert np.array_equal(rice_decode(unary, low, positions.size, k), positions)
    for dtype in (np.uint8, np.uint16, np.int32, np.int64):  # any integer values, cut into blocks
        values = rng.integers(0, 200, size=5_000).astype(dtype)
        unary, low = rice_pack(values, 4)
        assert np.array_equal(rice_unpack(unary, low, values.size, 4), values)
        assert (len(unary) * 8 - 7, len(low) * 8) <= (int((values >> 4).sum()) + values.size, values.size * 4 + 7)
    with pytest.raises(ValueError, match="non-negative"):
        rice_pack(np.array([3, -1, 2], dtype=np.int32), 2)
    far = np.array([0, 1, 2**33, 2**33 + 5, 2**40], dtype=np.int64)  # positions past int32, huge gaps
    assert np.array_equal(rice_decode(*rice_encode(far, 30), far.size, 30), far)


@pytest.mark.parametrize("block", [1 << 16, 1000, 7])
def test_ordered_mapping_is_a_bijection_and_ulp_steps_wrap_exactly(block, monkeypatch):
    monkeypatch.setattr(encoding, "_ULP_BLOCK", block)  # blocks that do not divide the length
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
    meta = enc.meta()
    meta["count"] += 5
    with pytest.raises((DeltaFormatError, ValueError)):
        apply_delta_bits(old.copy(), EncodedDelta.from_meta(meta, bytes(payload)))
    zipped = encode_delta(old, nudge(rng, old, 0.01), values="raw")
    assert zipped.zipped[-1]
    broken = bytearray(zipped.payload())
    broken[-3] ^= 0xFF
    with pytest.raises(DeltaFormatError):
        apply_delta_bits(old.copy(), EncodedDelta.from_meta(zipped.meta(), bytes(broken)))


def test_shape_and_dtype_mismatches_are_refused():
    old = np.zeros(10, dtype=np.uint16)
    with pytest.raises(ValueError):
        encode_delta(old, np.zeros(11, dtype=np.uint16))
    with pytest.raises(TypeError):
        encode_delta(old.astype(np.float32), old.astype(np.float32))
    enc = encode_delta(old, np.ones(10, dtype=np.uint16))
    with pytest.raises(TypeError):
        apply_delta(torch.zeros(10, dtype=torch.float16), enc)
    with pytest.raises(ValueError):
        apply_delta(torch.zeros(11, dtype=torch.bfloat16), enc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("positions", "values"), CODECS)
def test_apply_returns_the_publishers_change_sum(dtype, positions, values):
    """The reader's sum over what its target held and now holds equals the publisher's sum."""
    rng = np.random.default_rng(11)
    old = random_bits(rng, (41, 23))
    new = nudge(rng, old, 0.3)
    new.reshape(-1)[:3] = [NAN_PAYLOAD, NEG_ZERO, POS_INF]
    changes = find_changes(old, new)
    expected = change_sum(changes.positions, changes.old, changes.new)
    target = torch.from_numpy(old.view(np.int16).copy()).view(torch.bfloat16).to(dtype)
    assert apply_delta(target, encode_delta(old, new, positions=positions, values=values)) == expected
    assert bf16_bits(target, exact=True).tobytes() == new.tobytes()


@pytest.mark.parametrize(("positions", "values"), [("ef", "raw"), ("ef", "ulpf"), ("rice", "ulpr"), ("dense", "ulp")])
def test_change_sum_exposes_a_target_off_its_base_where_the_delta_touches(positions, values):
    rng = np.random.default_rng(12)
    old = random_bits(rng, (5000,))
    new = nudge(rng, old, 0.05)
    changes = find_changes(old, new)
    expected = change_sum(changes.positions, changes.old, changes.new)
    drifted = old.copy()
    drifted[changes.positions[7]] ^= 0x0001  # one touched value is not what the base version had
    target = torch.from_numpy(drifted.view(np.int16)).view(torch.bfloat16)
    assert apply_delta(target, encode_delta(old, new, positions=positions, values=values)) != expected


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


@pytest.mark.parametrize("size", [1, 5, 1000, 300_000, 1 << 20])
def test_rice_parameter_from_sampled_gaps(size):
    """The publisher picks k from sampled gaps without making them all: the same k as from all."""
    rng = np.random.default_rng(size)
    positions = np.sort(rng.choice(size * 40, size=size, replace=False)).astype(np.int64)
    assert best_rice_k_of_gaps(positions) == best_rice_k(position_gaps(positions))


@pytest.mark.parametrize("block", [1 << 16, 999])
@pytest.mark.parametrize("low_bits", [0, 8, 16])
def test_elias_fano_positions_roundtrip(low_bits, block, monkeypatch):
    monkeypatch.setattr(intcodes, "_BLOCK", block)  # the ramp restarted in every block
    rng = np.random.default_rng(13)
    positions = np.flatnonzero(rng.random(300_000) < 0.01)
    upper, lower = ef_pack(positions, low_bits)
    assert np.array_equal(ef_unpack(upper, lower, positions.size, low_bits), positions)
    assert len(upper) * 8 + len(lower) * 8 <= positions.size * (low_bits + 1) + (300_000 >> low_bits) + 8


@pytest.mark.parametrize("block", [1 << 16, 7])
@pytest.mark.parametrize("low_bits", [0, 8])
@pytest.mark.parametrize("where", ["first block", "block boundary", "last block"])
def test_elias_fano_rejects_positions_that_do_not_increase(low_bits, block, where, monkeypatch):
    """Low parts out of order within a high part (or, with no low bits, two terminators side by
    side) decode to unsorted or repeated positions: a clear format error, wherever in the stream,
    including across the decoder's blocks (a reader splits positions by tensor assuming order)."""
    monkeypatch.setattr(intcodes, "_BLOCK", block)
    # Pairs of changes sharing a 256-element high part: 5 and 9 past every multiple of 512.
    positions = (np.arange(20, dtype=np.int64)[:, None] * 512 + np.array([5, 9])).reshape(-1)
    i = {"first block": 1, "block boundary": 7 if block == 7 else 21, "last block": 39}[where]
    broken = positions.copy()
    if low_bits:  # the pair's low parts swapped: the same high parts, so the same unary stream
        broken[[i - 1, i]] = broken[[i, i - 1]]
        upper, _ = ef_pack(positions, low_bits)
        lower = broken.astype(np.uint8).tobytes()
    else:  # a repeated position: its terminator right after the one before
        broken[i] = broken[i - 1]
        upper, lower = ef_pack(broken, low_bits)
    with pytest.raises(DeltaFormatError, match="not increasing"):
        ef_unpack(upper, lower, broken.size, low_bits)


def test_position_codec_follows_density():
    rng = np.random.default_rng(14)
    old = random_bits(rng, (400_000,))
    chosen = {d: encode_delta(old, nudge(rng, old, d)) for d in (0.00005, 0.01, 0.1)}
    assert chosen[0.01].positions == "ef"  # cheapest to code and decode in the usual range
    assert chosen[0.1].positions == "rice"  # clearly smaller there
    for enc in chosen.values():
        assert enc.nbytes / enc.count < 3.0


def test_change_sum_keeps_its_definition_and_offsets_positions():
    """The sum is a contract between publisher and reader versions: check it against the formula
    in plain Python integers, and that `offset` equals shifting every position."""
    from rljob.weights.checksum import _VALUE_HASH

    rng = np.random.default_rng(5)
    positions = np.sort(rng.choice(1 << 40, size=1000, replace=False)).astype(np.int64)
    old = rng.integers(0, 2**16, size=1000, dtype=np.uint32).astype(np.uint16)
    new = rng.integers(0, 2**16, size=1000, dtype=np.uint32).astype(np.uint16)
    table = [int(v) for v in _VALUE_HASH]
    reference = sum((2 * int(p) + 1) * (table[n] - table[o]) for p, o, n in zip(positions, old, new, strict=True))
    assert change_sum(positions, old, new) == reference % 2**64
    assert change_sum(positions, old, new, offset=12345) == change_sum(positions + 12345, old, new)
    small = positions >> 12  # < 2**31: the same sum from int32 positions
    assert change_sum(small.astype(np.int32), old, new) == change_sum(small, old, new)


def test_run_length_zlib_is_as_small_as_level_6_on_wide_ulp_steps():
    """The value planes of a first AdamW step (wide, heavy-tailed ulp steps): zlib's run-length
    strategy must stay within 1% of level-6 string matching (it is several times faster)."""
    from rljob.weights.encoding import _maybe_zip, _split_planes, _unzip

    rng = np.random.default_rng(3)
    old = bf16_bits(torch.from_numpy(rng.standard_normal(400_000).astype(np.float32) * 0.02)).copy()
    steps = np.minimum(rng.lognormal(2.0, 1.5, old.size), 3000).astype(np.int32) * rng.choice([-1, 1], old.size)
    new = from_ordered((to_ordered(old).astype(np.int32) + steps).clip(-32768, 32767).astype(np.int16))
    planes = _split_planes(ulp_zigzag(old, new))
    packed, zipped = _maybe_zip(planes)
    assert zipped and len(packed) <= 1.01 * len(zlib.compress(planes, 6))
    assert _unzip(packed, True, len(planes)) == planes


@pytest.mark.parametrize("block", [1 << 16, 32, 7, 1])
def test_change_sum_of_parts_equals_the_sum_over_model_wide_positions(block, monkeypatch):
    """Also with blocks that cut through parts, end on part boundaries, and hold several parts."""
    from rljob.weights import checksum
    from rljob.weights.checksum import change_sum_of_parts

    monkeypatch.setattr(checksum, "_SUM_BLOCK", block)

    rng = np.random.default_rng(6)
    sizes = [5, 1, 40, 7, 300]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    local = [np.sort(rng.choice(n, size=max(1, n // 3), replace=False)).astype(np.int64) for n in sizes]
    starts = np.concatenate([[0], np.cumsum([p.size for p in local])[:-1]])
    positions = np.concatenate(local)
    old = rng.integers(0, 2**16, size=positions.size, dtype=np.uint32).astype(np.uint16)
    new = rng.integers(0, 2**16, size=positions.size, dtype=np.uint32).astype(np.uint16)
    model_wide = np.concatenate([p + o for p, o in zip(local, offsets, strict=True)])
    assert change_sum_of_parts(positions, old, new, starts, offsets) == change_sum(model_wide, old, new)
    assert change_sum_of_parts(positions[:0], old[:0], new[:0], starts[:0], offsets[:0]) == 0


def adamw_like_steps(rng: np.random.Generator, size: int, scale: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """Old values and new ones moved by heavy-tailed ulp steps (small weights move by many ulp)."""
    old = bf16_bits(torch.from_numpy(rng.standard_normal(size).astype(np.float32) * 0.02)).copy()
    steps = np.maximum(1, np.minimum(rng.lognormal(1.0, scale, size), 30000)).astype(np.int32)
    steps *= rng.choice([-1, 1], size)
    new = from_ordered((to_ordered(old).astype(np.int32) + steps).clip(-32768, 32767).astype(np.int16))
    return old, new


def test_zipped_size_estimate_is_close_on_wide_steps():
    from rljob.weights.encoding import _maybe_zip, _split_planes, _zipped_size_estimate

    old, new = adamw_like_steps(np.random.default_rng(21), 1_500_000)  # 3 MB planes: sampled
    for planes in (_split_planes(ulp_zigzag(old, new)), _split_planes(new)):
        actual = len(_maybe_zip(planes)[0])
        assert abs(_zipped_size_estimate(planes) - actual) <= 0.05 * actual


@pytest.mark.parametrize("case", ["adamw", "noise"])
def test_pruning_wide_step_codings_keeps_the_smallest(case, monkeypatch):
    """Building only the candidates near the smallest estimate gives the same bytes as building
    and compressing them all: where one coding is far smaller (AdamW-like steps: only the zipped
    byte coding is built) and where all are near 2 bytes (new values unrelated to the old: all built)."""
    rng = np.random.default_rng(22)
    old, new = adamw_like_steps(rng, 1_200_000)
    if case == "noise":
        new = rng.integers(0, 2**16, size=old.size, dtype=np.uint32).astype(np.uint16)
    changes = find_changes(old, new)
    built = encoding._encode_values(changes.old, changes.new, None, False, 1)
    assert len(built) == (1 if case == "adamw" else 3)
    pruned = encode_changes(changes, old.size)
    monkeypatch.setattr(encoding, "_KEEP_WITHIN", float("inf"))
    exhaustive = encode_changes(changes, old.size)
    assert pruned.meta() == exhaustive.meta() and pruned.payload() == exhaustive.payload()
    bits = old.copy()
    apply_delta_bits(bits, EncodedDelta.from_meta(pruned.meta(), pruned.payload()))
    assert np.array_equal(bits, new)


@pytest.mark.parametrize(
    ("numel", "positions"), [(3_000_000_000, [1_700_000_000]), (7_000_000_000, [5, 3_000_000_000, 6_999_999_999])]
)
def test_a_few_changes_in_billions_of_values_are_coded(numel, positions):
    # Gaps of 2^30 and more: the Rice width is capped at the widest fast one instead of finding no
    # candidate (publishing such a version raised "min() arg is an empty sequence"). The changes
    # alone are coded; no model of that size is allocated.
    from rljob.weights.changes import Changes
    from rljob.weights.encoding import decode_positions

    where = np.array(positions, dtype=np.int64)
    changes = Changes(where, np.ones(where.size, dtype=np.uint16), np.full(where.size, 2, dtype=np.uint16))
    for forced in (None, "rice", "ef"):
        enc = encode_changes(changes, numel, positions=forced)
        assert np.array_equal(decode_positions(EncodedDelta.from_meta(enc.meta(), enc.payload())), where)
    gaps = position_gaps(where)
    assert best_rice_k(gaps) <= 28 and intcodes.estimate_rice_bits(where.size, int(gaps.sum())) > 0
