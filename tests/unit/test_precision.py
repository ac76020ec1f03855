"""Which dtype the policy computes in: processor flags decide `auto` on CPU."""

from __future__ import annotations

import pytest
import torch

from rljob import precision
from rljob.config import ModelSpec

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_flags_decide_fast_bf16() -> None:
    assert precision.has_fast_bf16(precision.cpu_flags(ZEN5), "x86_64")
    assert not precision.has_fast_bf16(precision.cpu_flags(SKYLAKE), "x86_64")
    assert precision.has_fast_bf16(precision.cpu_flags(GRAVITON3), "aarch64")
    assert not precision.has_fast_bf16(set(), "x86_64")


def test_auto_follows_the_cpu_and_explicit_dtypes_are_kept(monkeypatch) -> None:
    assert ModelSpec().dtype == "auto"
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert precision.compute_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert precision.compute_dtype("auto", "cpu") == torch.bfloat16
    assert precision.compute_dtype("auto", "cuda") == torch.bfloat16
    assert precision.compute_dtype("float32", "cpu") == torch.float32
    assert precision.compute_dtype("bfloat16", "cpu") == torch.bfloat16


def test_flags_that_promise_bf16_are_checked_by_measuring_it(monkeypatch) -> None:
    monkeypatch.setattr(precision.Path, "read_text", lambda self: ZEN5)
    for speedup, fast in ((3.7, True), (0.6, False), (1.1, False)):
        precision.cpu_has_fast_bf16.cache_clear()
        monkeypatch.setattr(precision, "measured_bf16_speedup", lambda s=speedup: s)
        assert precision.cpu_has_fast_bf16() is fast
    precision.cpu_has_fast_bf16.cache_clear()
    monkeypatch.setattr(precision.Path, "read_text", lambda self: SKYLAKE)
    monkeypatch.setattr(precision, "measured_bf16_speedup", lambda: pytest.fail("no bf16 flag: nothing to measure"))
    assert precision.cpu_has_fast_bf16() is False
    precision.cpu_has_fast_bf16.cache_clear()


def test_the_probe_times_real_products() -> None:
    threads = torch.get_num_threads()
    assert precision.product_seconds(torch.ones(8, 8), torch.ones(8, 8)) > 0
    assert precision.measured_bf16_speedup((32, 64, 64), rounds=2) > 0
    assert torch.get_num_threads() == threads
