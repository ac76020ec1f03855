"""Which dtype the policy computes in: bf16 where the hardware multiplies it fast, else fp32.

On a CPU with AVX512_BF16 or AMX, bf16 matrix products run about twice as fast as fp32 or more
(`docs/results/step_speed.md`); without them torch emulates bf16 and it is slower than fp32. The
check reads the processor's flags once per process and logs the choice. `spec.model.dtype` set
to anything but `auto` is taken as given, on any device.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}  # x86 (/proc/cpuinfo "flags")
_FAST_BF16_FEATURES = {"bf16"}  # aarch64 (/proc/cpuinfo "Features"): BFMMLA and friends


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


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    fast = has_fast_bf16(cpu_flags(text), platform.machine())
    log.info("CPU bf16 matrix products: %s", "fast (bf16 compute)" if fast else "not native (fp32 compute)")
    return fast


def compute_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """The dtype `spec.model.dtype` means on `device`; `auto` is bf16 on CUDA and on fast-bf16 CPUs."""
    if dtype != "auto":
        return DTYPES[dtype]
    if torch.device(device).type == "cpu" and not cpu_has_fast_bf16():
        return torch.float32
    return torch.bfloat16
