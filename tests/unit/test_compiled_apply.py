"""The compiled apply (one torch.compile kernel per tensor) writes exactly what numpy's apply
writes and returns the same change sum, for every value coding, bf16 and fp32 targets and every
kind of pattern; and when it cannot compile, or compiles something wrong, numpy's path is used
with nothing half-applied."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from rljob.weights import compiled_apply
from rljob.weights.apply import apply_stream
from rljob.weights.changes import find_changes, merge_changes
from rljob.weights.checksum import bf16_bits, change_sum
from rljob.weights.encoding import EncodedDelta, encode_changes, from_ordered, to_ordered

# Parts above and below MIN_PART, an untouched tensor, a 0-d one.
SHAPES = [(40, 50), (3,), (700,), (), (64, 33), (9,)]
SPECIAL = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7FFF, 0x0001, 0x8001], dtype=np.uint16)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test sees the compiled path unprobed and ``on``, and its calls listed: (target dtype,
    size)."""
    monkeypatch.setattr(compiled_apply, "_ready", set())
    monkeypatch.setattr(compiled_apply, "_broken", None)
    monkeypatch.setattr(compiled_apply, "_warming", {})
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "on")  # compiled in the caller's thread
    calls = []
    original = compiled_apply._compiled_kernel()

    def counted(*args):
        calls.append((args[0].dtype, args[0].numel()))
        return original(*args)

    monkeypatch.setattr(compiled_apply, "_compiled", counted)
    return calls


def make_stream(rng: np.random.Generator, kind: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    olds, news = [], []
    for shape in SHAPES:
        size = int(np.prod(shape))
        old = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
        old[: min(size, SPECIAL.size)] = SPECIAL[: min(size, SPECIAL.size)]
        new = old.copy()
        if size != 3:  # one tensor stays as it was
            picked = np.flatnonzero(rng.random(size) < 0.5)
            if kind == "small":  # ulp steps of 1-3 either way, wrapping at the ends of the number line
                steps = rng.integers(1, 4, picked.size) * rng.choice([-1, 1], picked.size)
                new[picked] = from_ordered((to_ordered(old[picked]).astype(np.int32) + steps).astype(np.int16))
            else:  # any pattern to any other
                new[picked] = rng.integers(0, 1 << 16, size=picked.size, dtype=np.uint16)
        olds.append(old)
        news.append(new)
    return olds, news


def merged_changes(olds: list[np.ndarray], news: list[np.ndarray]):
    found = [find_changes(o, n) for o, n in zip(olds, news, strict=True)]
    return merge_changes(found, [o.size for o in olds])


def targets_of(bits: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        torch.from_numpy(b.copy().view(np.int16)).view(torch.bfloat16).reshape(s).to(dtype)
        for b, s in zip(bits, SHAPES, strict=True)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("kind", "values"), [("small", "ulpf"), ("small", "ulpr"), ("small", "ulp"), ("any", "ulp"), ("any", "raw")]
)
def test_the_compiled_apply_writes_what_numpy_writes(fresh_state, monkeypatch, dtype, kind, values):
    rng = np.random.default_rng(len(kind) * 7 + len(values))
    olds, news = make_stream(rng, kind)
    changes, numel = merged_changes(olds, news)
    enc = encode_changes(changes, numel, values=values)
    enc = EncodedDelta.from_meta(enc.meta(), enc.payload())
    sizes = [o.size for o in olds]
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("RLJOB_COMPILED_APPLY", mode)
        targets = targets_of(olds, dtype)
        total, touched = apply_stream(targets, sizes, enc)
        results[mode] = (total, touched, [bf16_bits(t, exact=True).copy() for t in targets])
    assert compiled_apply._broken is None
    memory_dtype = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert {size for kind, size in fresh_state if kind == memory_dtype} >= {2000, 700, 2112}  # beyond its check
    assert results["on"][0] == results["off"][0] == change_sum(changes.positions, changes.old, changes.new)
    assert results["on"][1] == results["off"][1]
    for got, want in zip(results["on"][2], news, strict=True):
        assert np.array_equal(got, want)


def test_a_dense_stream_takes_it_by_default_and_a_sparse_one_does_not(fresh_state, monkeypatch):
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "auto")
    assert compiled_apply.wanted(50, 1000) and not compiled_apply.wanted(49, 1000)
    assert not compiled_apply.wanted(0, 1000)


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "sometimes")
    with pytest.raises(ValueError, match="RLJOB_COMPILED_APPLY"):
        compiled_apply.wanted(10, 10)
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "off")
    assert not compiled_apply.wanted(10, 10)
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "on")
    assert compiled_apply.wanted(1, 10**9)


def _stream(seed: int = 0):
    olds, news = make_stream(np.random.default_rng(seed), "small")
    changes, numel = merged_changes(olds, news)
    return olds, news, encode_changes(changes, numel)


def test_a_kernel_that_cannot_compile_leaves_numpy_in_use(monkeypatch, caplog):
    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(compiled_apply, "_compiled", no_compiler)
    olds, news, enc = _stream()
    targets = targets_of(olds, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="rljob.weights.compiled_apply"):
        apply_stream(targets, [o.size for o in olds], enc)
        again = targets_of(olds, torch.bfloat16)
        apply_stream(again, [o.size for o in olds], enc)
    for got, more, want in zip(targets, again, news, strict=True):
        assert np.array_equal(bf16_bits(got, exact=True), want) and np.array_equal(bf16_bits(more, exact=True), want)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # warned once
    assert "no working C++ compiler" in caplog.records[0].message
    assert not compiled_apply.wanted(10, 10)


def test_a_kernel_that_computes_wrong_is_caught_before_any_target_is_touched(monkeypatch, caplog):
    original = compiled_apply._compiled_kernel()

    def off_by_one(memory, *args):
        out = original(memory, *args)
        memory[0] += 1
        return out

    monkeypatch.setattr(compiled_apply, "_compiled", off_by_one)
    olds, news, enc = _stream(1)
    targets = targets_of(olds, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="rljob.weights.compiled_apply"):
        apply_stream(targets, [o.size for o in olds], enc)
    assert "disagrees with numpy" in caplog.text
    for got, want in zip(targets, news, strict=True):
        assert np.array_equal(bf16_bits(got, exact=True), want)


def test_readers_in_threads_apply_at_once(fresh_state):
    olds, news, enc = _stream(2)
    errors: list[BaseException] = []
    outputs = [targets_of(olds, torch.bfloat16) for _ in range(4)]

    def run(targets):
        try:
            apply_stream(targets, [o.size for o in olds], enc)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in outputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and compiled_apply._broken is None
    assert sum(size == 2000 for _, size in fresh_state) == 4
    for targets in outputs:
        for got, want in zip(targets, news, strict=True):
            assert np.array_equal(bf16_bits(got, exact=True), want)


def test_importing_the_weight_store_does_not_import_the_compiler():
    """torch.compile imports dynamo and inductor (seconds): every trainer, worker and CLI process
    imports the weight store, and only a reader of a dense delta needs them."""
    code = "import sys, rljob.weights.apply, rljob.weights.reader; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_by_default_the_kernel_compiles_in_the_background_while_numpy_applies(fresh_state, monkeypatch):
    """A reader's sync never waits for a compiler: the first dense stream is applied by numpy
    while the kernel compiles; once it is ready, streams take it."""
    monkeypatch.setenv("RLJOB_COMPILED_APPLY", "auto")
    olds, news, enc = _stream(3)
    sizes = [o.size for o in olds]
    first = targets_of(olds, torch.bfloat16)
    apply_stream(first, sizes, enc)
    assert not any(size == 2000 for _, size in fresh_state)  # numpy applied the first stream
    assert compiled_apply.wait_until_compiled(timeout=600)
    second = targets_of(olds, torch.bfloat16)
    apply_stream(second, sizes, enc)
    assert sum(size == 2000 for _, size in fresh_state) == 1  # the kernel applied the second
    for a, b, want in zip(first, second, news, strict=True):
        assert np.array_equal(bf16_bits(a, exact=True), want) and np.array_equal(bf16_bits(b, exact=True), want)
