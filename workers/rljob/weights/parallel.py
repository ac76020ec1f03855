"""What keeps publishing and applying a version fast: a small reusable thread pool for its
per-tensor work, and the cyclic garbage collector held off while it runs.

Tensors are independent, and numpy, torch and hashlib release the GIL for the bulk of the work
(casts, compares, gathers, hashes), so the per-tensor work of a version spreads over cores.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the block (reference counting still frees memory); nests safely.

    A version allocates a few thousand small objects (the manifest's entries), which can trigger a
    full collection, longer than a whole delta, in the middle of a sync. The collection is
    deferred, not skipped: it runs between versions, where nobody waits on it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


def one_torch_thread_here() -> None:
    """Make torch's own ops run on one core in the calling thread only.

    A pool thread is one of `threads` already spread over the cores; left alone, each torch op in
    it (the publisher's cast, the reader's scatter) starts an OpenMP team of every core.
    `torch.set_num_threads(1)` would also change the default of every thread started later; OpenMP's
    `omp_set_num_threads` sets the calling thread's value only, after `get_num_threads` made torch
    initialise this thread (else it would overwrite the value later). Without OpenMP, no change.
    """
    import torch

    torch.get_num_threads()
    try:
        set_omp_threads = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return
    set_omp_threads(1)


# Batches per thread in `TensorPool.map`: a few, so a thread that drew cheap ones takes another.
_BATCHES_PER_THREAD = 4


def balanced_batches(items: list[T], cost: Callable[[T], float] | None, batches: int) -> list[list[T]]:
    """`items` cut into at most `batches` contiguous runs of about equal total cost (order kept).

    Each run closes once it holds its share of what is left, so one heavy item makes a run of its
    own and the rest split evenly.
    """
    if len(items) <= batches:
        return [[x] for x in items]
    weights = [float(cost(x)) if cost else 1.0 for x in items]
    out: list[list[T]] = []
    run: list[T] = []
    left, runs_left, in_run = sum(weights), batches, 0.0
    for x, weight in zip(items, weights, strict=True):
        run.append(x)
        in_run += weight
        if runs_left > 1 and in_run >= left / runs_left:
            out.append(run)
            left, runs_left, run, in_run = left - in_run, runs_left - 1, [], 0.0
    if run:
        out.append(run)
    return out


class TensorPool:
    """`map` over tensors on `threads` threads (in the caller's thread when 1). Started lazily."""

    # Run in each pool thread as it starts: a pool thread is one core's worth, so torch's ops in
    # it stay on that core.
    thread_setup: Callable[[], None] | None = staticmethod(one_torch_thread_here)

    def __init__(self, threads: int | None = None, name: str = "weights") -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Iterable[T], cost: Callable[[T], float] | None = None) -> list[R]:
        """`[fn(x) for x in items]`, in order; the first exception raised is re-raised here.

        Items run in contiguous batches, a few per thread, of about equal total `cost` (default:
        equal counts): a pool task costs tens of microseconds, too much for one per tensor.
        """
        items = list(items)
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        batches = balanced_batches(items, cost, self.threads * _BATCHES_PER_THREAD)
        done = self._executor().map(lambda batch: [fn(x) for x in batch], batches)
        return [result for batch in done for result in batch]

    def submit(self, fn: Callable[[], R]) -> Future[R]:
        """Run `fn` on a pool thread (in the caller's thread when 1, returning a finished future),
        for work that overlaps with what the caller does next."""
        if self.threads == 1:
            done: Future[R] = Future()
            try:
                done.set_result(fn())
            except Exception as error:  # delivered by result(), as from a thread
                done.set_exception(error)
            return done
        return self._executor().submit(fn)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name, initializer=self.thread_setup)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
