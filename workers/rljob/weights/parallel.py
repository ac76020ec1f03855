"""A small reusable thread pool for the per-tensor work of publishing and applying a version.

Tensors are independent, and numpy, torch and hashlib release the GIL for the bulk of the work
(casts, compares, gathers, hashes), so the per-tensor work of a version spreads over cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def cgroup_cpu_limit(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs allowed by a cgroup v2 quota (a pod's `resources.limits.cpu`), or None when unlimited.

    A container sees every core of its node in its affinity mask, so a pool sized by the mask alone
    would be throttled by the quota.
    """
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def default_threads() -> int:
    """The cores this process may use (affinity and cgroup quota), at most 8 (beyond that memory
    bandwidth is the limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, int(limit)))
    return max(1, min(8, cores))


class TensorPool:
    """`map` over tensors on `threads` threads (in the caller's thread when 1). Started lazily."""

    def __init__(self, threads: int | None = None, name: str = "weights") -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[fn(x) for x in items]`, in order; the first exception raised is re-raised here."""
        items = list(items)
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
