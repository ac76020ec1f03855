"""Where the publisher's time goes: its one pass over the model, on 1 and 2 threads.

The delta path's floor is the pass that finds the changed bf16 values: cast the fp32 masters to
bf16 and compare them with the published baseline. This measures, on SmolLM2-135M-Instruct with 1%
of the values changed: reading the masters and the baseline once (plain sums: the floor), the
cast alone, the whole find pass (cast, compare, positions, gathers) with
256K- and 1M-element blocks, on 1 and 2 threads; and the pass on two pool threads with torch
at its default thread count, each pool thread starting an OpenMP team per op
or held to one torch thread (`parallel.one_torch_thread_here`). Best of `--reps`. Writes
docs/results/weight_pass.json.
  python benchmarks/bench_weight_pass.py
"""

from __future__ import annotations

import argparse
import time

import bench_weight_delta
import numpy as np
import redis
import torch
from _common import finish, progress
from bench_weight_delta import as_fp32, load_weights, nudge

from rljob.keys import JobKeys
from rljob.weights import changes, publisher
from rljob.weights.checksum import bf16_bits
from rljob.weights.parallel import TensorPool


def best_of(reps: int, run, prepare=lambda: None) -> float:
    best = float("inf")
    for _ in range(reps):
        prepare()
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


class ThreadsAsStarted(TensorPool):
    """A TensorPool whose threads keep torch's process default (what it did before
    `parallel.one_torch_thread_here`): the baseline of the torch-threads rows."""

    thread_setup = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", default=None, help="folder for weight_pass.json (default docs/results)")
    parser.add_argument(
        "--weights",
        choices=sorted(bench_weight_delta.MODELS),
        default="smollm2",
        help="the real model, or its shapes with a random init (as bench_weight_delta.py)",
    )
    args = parser.parse_args()
    bench_weight_delta.WEIGHTS = args.weights
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    weights = load_weights()
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    bits = {name: bf16_bits(t).copy() for name, t in weights.items()}
    source = as_fp32(nudge(bits, 0.01, np.random.default_rng(0)), shapes)
    order = sorted(source, key=lambda name: -source[name].numel())
    # A real publisher, used only for its cast-and-find helpers: it never talks to Redis here
    # (redis-py connects on first use).
    pub = publisher.WeightPublisher(
        redis.Redis(), JobKeys("bench", "pass"), rebase_interval=1, rebase_fraction=1.0, chunk_bytes=1 << 20, threads=1
    )
    summary: dict = {
        "numel": sum(b.size for b in bits.values()),
        "density": 0.01,
        "reps": args.reps,
        "model": bench_weight_delta.MODELS[args.weights],
        "rows": [],
    }

    def reset_baseline() -> None:
        pub._baseline = {name: b.copy() for name, b in bits.items()}

    def cast_only(name: str) -> None:
        cast, numel = pub._new_bits(source[name]), source[name].numel()
        for start in range(0, numel, publisher._CAST_BLOCK):
            cast(start, min(start + publisher._CAST_BLOCK, numel))

    def read_only(name: str) -> None:
        """What any find pass must at least do: read the masters and the baseline once (the floor
        the cast and the compare are measured against)."""
        source[name].sum()
        words = bits[name][: bits[name].size // 4 * 4].view(np.int64)  # torch's int16 sum is not vectorised
        torch.from_numpy(words).sum()

    summary["read_alone_s"] = {}
    saved = changes._COMPARE_BLOCK, publisher._CAST_BLOCK
    try:
        for threads in (1, 2):
            pool = TensorPool(threads)
            read = best_of(args.reps, lambda p=pool: p.map(read_only, order))
            summary["read_alone_s"][str(threads)] = read
            progress(f"threads {threads}: reading the masters and the baseline once (sums) {read * 1e3:.0f} ms")
            for block in (1 << 18, 1 << 20):
                changes._COMPARE_BLOCK = publisher._CAST_BLOCK = block
                cast = best_of(args.reps, lambda p=pool: p.map(cast_only, order), reset_baseline)
                find = best_of(
                    args.reps, lambda p=pool: p.map(lambda n: pub._find_one(n, source[n], None), order), reset_baseline
                )
                row = {"threads": threads, "block": block, "cast_s": cast, "find_s": find}
                summary["rows"].append(row)
                progress(
                    f"threads {threads} block {block >> 10}K: cast alone {cast * 1e3:.0f} ms, "
                    f"find pass {find * 1e3:.0f} ms"
                )
            pool.close()
    finally:
        changes._COMPARE_BLOCK, publisher._CAST_BLOCK = saved

    # torch's own threads inside the pool's: with the process at torch's default (every core), a
    # pool whose threads start an OpenMP team per op against TensorPool's (one torch thread each).
    torch.set_num_threads(default_threads)
    summary["torch_threads_in_pool"] = {"process_torch_threads": default_threads}
    for label, pool in (("omp team per op", ThreadsAsStarted(2)), ("one torch thread", TensorPool(2))):
        find = best_of(
            args.reps, lambda p=pool: p.map(lambda n: pub._find_one(n, source[n], None), order), reset_baseline
        )
        summary["torch_threads_in_pool"][label] = find
        progress(
            f"threads 2, torch at {default_threads} threads in the process, {label} per pool thread: "
            f"find pass {find * 1e3:.0f} ms"
        )
        pool.close()
    ratio = summary["torch_threads_in_pool"]["omp team per op"] / summary["torch_threads_in_pool"]["one torch thread"]
    summary["torch_threads_in_pool"]["speedup"] = ratio
    progress(f"one torch thread per pool thread: x{ratio:.2f}")
    torch.set_num_threads(1)

    finish("weight_pass", summary, args.results)


if __name__ == "__main__":
    main()
