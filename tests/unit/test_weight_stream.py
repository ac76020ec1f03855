"""One delta stream over many tensors: coding the merged changes and applying them per tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rljob.weights.apply import apply_stream, gather_bits, scatter_bits
from rljob.weights.changes import Changes, find_changes, merge_changes
from rljob.weights.checksum import bf16_bits, change_sum
from rljob.weights.codec import DeltaFormatError, EncodedDelta, encode
from rljob.weights.parallel import TensorPool

SHAPES = [(7, 5), (0,), (1,), (300,), (), (64, 33)]


def random_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)


def merged(olds: list[np.ndarray], news: list[np.ndarray]) -> tuple[Changes, int]:
    return merge_changes([find_changes(o, n) for o, n in zip(olds, news, strict=True)], [o.size for o in olds])


def as_tensor(bits: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(bits.copy().view(np.int16)).view(torch.bfloat16).reshape(shape)
    return t.to(dtype)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_stream_over_tensors_round_trips_bit_exactly(density, dtype, threads):
    rng = np.random.default_rng(int(density * 100) + threads)
    olds = [random_bits(rng, s) for s in SHAPES]
    news = []
    for old in olds:
        new = old.copy()
        picked = rng.random(old.size) < density
        new[picked] = rng.integers(0, 1 << 16, size=int(picked.sum()), dtype=np.uint16)
        news.append(new)
    changes, numel = merged(olds, news)
    enc = encode(changes, numel)
    enc = EncodedDelta.from_meta(enc.meta(), enc.payload())
    targets = [as_tensor(o, s, dtype) for o, s in zip(olds, SHAPES, strict=True)]
    storages = [t.untyped_storage().data_ptr() for t in targets]
    total, touched = apply_stream(targets, [o.size for o in olds], enc, TensorPool(threads))
    assert total == change_sum(changes.positions, changes.old, changes.new)
    assert touched == [i for i, (o, n) in enumerate(zip(olds, news, strict=True)) if not np.array_equal(o, n)]
    for target, new, ptr in zip(targets, news, storages, strict=True):
        assert np.array_equal(bf16_bits(target, exact=True), new)
        assert target.untyped_storage().data_ptr() == ptr  # in place


def test_untouched_tensors_may_be_absent_and_touched_ones_must_fit():
    rng = np.random.default_rng(0)
    olds = [random_bits(rng, (10,)), random_bits(rng, (20,))]
    news = [olds[0].copy(), olds[1].copy()]
    news[1][[3, 17]] ^= 1
    changes, numel = merged(olds, news)
    enc = encode(changes, numel)
    target = as_tensor(olds[1], (20,), torch.bfloat16)
    apply_stream([None, target], [10, 20], enc)
    assert np.array_equal(bf16_bits(target), news[1])
    with pytest.raises(ValueError, match="no target"):
        apply_stream([as_tensor(olds[0], (10,), torch.bfloat16), None], [10, 20], enc)
    with pytest.raises(ValueError, match="has 21 elements"):
        apply_stream([None, torch.zeros(21, dtype=torch.bfloat16)], [10, 20], enc)
    with pytest.raises(DeltaFormatError, match="for 30 elements"):
        apply_stream([None, target], [10, 21], enc)


def test_a_stream_that_differs_from_the_target_fails_its_change_sum():
    """The sum covers what the target held: a target off the base version gives another sum."""
    rng = np.random.default_rng(1)
    old = random_bits(rng, (50,))
    new = old.copy()
    new[[5, 9]] += 1
    changes, numel = merged([old], [new])
    enc = encode(changes, numel)
    expected = change_sum(changes.positions, changes.old, changes.new)
    drifted = old.copy()
    drifted[9] ^= 0x10
    target = as_tensor(drifted, (50,), torch.float32)
    total, _ = apply_stream([target], [50], enc)
    assert total != expected


def test_every_value_changed_is_coded_like_any_other():
    old = np.arange(8, dtype=np.uint16)
    new = old + 1
    enc = encode(find_changes(old, new), 8)
    assert enc.count == 8
    target = as_tensor(old, (8,), torch.bfloat16)
    apply_stream([target], [8], enc)
    assert np.array_equal(bf16_bits(target), new)


def test_gather_and_scatter_bits_on_bf16_and_fp32():
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.tensor([1.0, -2.0, 3.5, 0.0], dtype=dtype)
        positions = np.array([1, 3])
        assert list(gather_bits(t, positions)) == list(bf16_bits(t)[[1, 3]])
        values = bf16_bits(torch.tensor([7.0, -0.0]))
        scatter_bits(t, positions, values)
        assert t.tolist() == [1.0, 7.0, 3.5, -0.0] and str(t[3].item()) == "-0.0"


def test_gather_into_out_and_every_element_gather_and_scatter():
    """`out` receives the gathered patterns (apply_stream's per-tensor slices of one buffer); every
    element can be read or written; NaN payloads, infinities and -0 keep their bits on both target
    dtypes."""
    patterns = np.array([0x7FC1, 0xFF80, 0x8000, 0x3F80, 0x0001, 0xC2F7], dtype=np.uint16)
    everywhere = np.arange(patterns.size, dtype=np.int64)
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.from_numpy(patterns.view(np.int16).copy()).view(torch.bfloat16).to(dtype)
        buffer = np.full(4, 0xAAAA, dtype=np.uint16)
        got = gather_bits(t, np.array([5, 0, 2], dtype=np.int64), out=buffer[1:])
        assert np.shares_memory(got, buffer) and buffer.tolist() == [0xAAAA, 0xC2F7, 0x7FC1, 0x8000]
        assert gather_bits(t, everywhere).tolist() == patterns.tolist()
        scatter_bits(t, everywhere, patterns[::-1].copy())
        assert bf16_bits(t, exact=True).tolist() == patterns[::-1].tolist()
        scatter_bits(t, np.array([0, 5], dtype=np.int64), np.array([0x0002, 0xFFFF], dtype=np.uint16))
        expected = patterns[::-1].copy()
        expected[[0, 5]] = [0x0002, 0xFFFF]
        assert bf16_bits(t, exact=True).tolist() == expected.tolist()
