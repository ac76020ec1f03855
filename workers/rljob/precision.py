"""Which dtype the policy computes in: bf16 where the hardware multiplies it fast, else fp32.

On a CPU with AVX512_BF16 or AMX, bf16 matrix products usually run several times faster than fp32;
without them torch emulates bf16 and it is slower than fp32. The flags are not enough: a virtual
machine can show AVX512_BF16 and still multiply bf16 slower than fp32 (`docs/results/step_speed.md`).
So where the flags promise bf16, a fraction of a second of matrix products in both dtypes decides,
once per process, and the choice is logged. `spec.model.dtype` set to anything but `auto` is taken
as given, on any device.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}  # x86 (/proc/cpuinfo "flags")
_FAST_BF16_FEATURES = {"bf16"}  # aarch64 (/proc/cpuinfo "Features"): BFMMLA and friends
PROBE_SHAPE = (256, 576, 1536)  # tokens x hidden x MLP width: one of SmolLM2-135M's products
MIN_BF16_SPEEDUP = 1.2  # bf16 must beat fp32 clearly to be worth its rounding


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's first processor (x86 `flags`, aarch64 `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def has_fast_bf16(flags: set[str], machine: str) -> bool:
    wanted = _FAST_BF16_FEATURES if machine in ("aarch64", "arm64") else _FAST_BF16_FLAGS
    return bool(flags & wanted)


def product_seconds(a: torch.Tensor, b: torch.Tensor, reps: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return (time.perf_counter() - start) / reps


def measured_bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE, rounds: int = 7) -> float:
    """fp32 time / bf16 time of one product on one thread. The two dtypes alternate
    and each keeps its fastest round, so a neighbour's load (a trainer and a worker starting side
    by side) slows both alike instead of deciding the verdict."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(rounds):
            for dtype, (x, y) in pairs.items():
                best[dtype] = min(best[dtype], product_seconds(x, y))
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    if not has_fast_bf16(cpu_flags(text), platform.machine()):
        log.info("CPU bf16 matrix products: not native (fp32 compute)")
        return False
    speedup = measured_bf16_speedup()
    fast = speedup >= MIN_BF16_SPEEDUP
    log.info(
        "CPU bf16 matrix products: %.2fx fp32, measured (%s)",
        speedup,
        "bf16 compute" if fast else f"under {MIN_BF16_SPEEDUP}x: fp32 compute",
    )
    return fast


def compute_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """The dtype `spec.model.dtype` means on `device`; `auto` is bf16 on CUDA and on fast-bf16 CPUs."""
    if dtype != "auto":
        return DTYPES[dtype]
    if torch.device(device).type == "cpu" and not cpu_has_fast_bf16():
        return torch.float32
    return torch.bfloat16
