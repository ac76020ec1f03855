"""The weight-delta benchmark on an earlier revision and on this checkout, run in turns, side by side.

This machine's speed drifts by 20-30% over minutes, so figures from runs an hour apart cannot
show a change of that size. Alternating the two revisions (base, this checkout, base, ...) puts
both under the same conditions; each row keeps the median over the pairs. The base revision is
checked out in a temporary git worktree and imported from there (PYTHONPATH), with the same
virtual environment. Writes <out>.json and <out>.png (the gains per row) and prints one line per
row and metric:
  python benchmarks/compare_revisions.py --base bf38613 --pairs 3 --out docs/results/weight_delta_ab
Arguments after `--` go to bench_weight_delta.py (default: none, the full benchmark). Each side
runs its own revision's benchmark script, unless `--same-script`: then both run this checkout's
(for a base whose packages have the same API), so that a change in how the benchmark measures
does not pass for a change in the code it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import progress

REPO = Path(__file__).resolve().parents[1]
# Per row: (JSON key, label, higher is better).
METRICS = (
    ("speedup_1_reader", "speed-up vs full, 1 reader", True),
    ("decode_apply_gbps", "decode+apply GB/s, one thread", True),
    ("decode_apply_gbps_median", "decode+apply GB/s, median of the runs", True),
    ("encode_gbps", "encode GB/s", True),
    ("publish_s", "publish s", False),
    ("latency_1_reader_s", "latency 1 reader s", False),
    ("bytes_per_changed_value", "B/change", False),
)


def run_bench(tree: Path, out: Path, bench_args: list[str], script_tree: Path | None = None) -> dict:
    """One benchmark run with the `rljob` packages of `tree` and the benchmark script of
    `script_tree` (default `tree`); its JSON summary (rows included)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "workers"), str(tree / "operator")]))
    script = (script_tree or tree) / "benchmarks" / "bench_weight_delta.py"
    command = [sys.executable, str(script), "--out", str(out), *bench_args]
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".json").read_text())


def by_row(run: dict) -> dict[str, dict]:
    return {f"{row['workload']} {row['label']}": row for row in run["rows"]}


def compare(base_runs: list[dict], head_runs: list[dict]) -> list[dict]:
    """Median of each metric per row over the runs of each side, and head / base (or base / head
    for times, so that above 1 is always better)."""
    base_rows, head_rows = [by_row(run) for run in base_runs], [by_row(run) for run in head_runs]
    table = []
    for name in head_rows[0]:
        for key, label, higher_better in METRICS:
            base = statistics.median(rows[name][key] for rows in base_rows)
            head = statistics.median(rows[name][key] for rows in head_rows)
            gain = (head / base if higher_better else base / head) if base and head else None
            table.append({"row": name, "metric": key, "label": label, "base": base, "head": head, "gain": gain})
    return table


def plot(table: list[dict], base: str, path: Path) -> None:
    """Grouped bars: head/base per row for the speed metrics (above 1: this checkout is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys(entry["row"] for entry in table))
    shown = [(key, label) for key, label, _ in METRICS if key not in ("bytes_per_changed_value", "latency_1_reader_s")]
    gains = {(entry["row"], entry["metric"]): entry["gain"] or 0.0 for entry in table}
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(shown)
    for j, (key, label) in enumerate(shown):
        ax.bar([i + j * width for i in range(len(rows))], [gains[(row, key)] for row in rows], width, label=label)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks([i + width * (len(shown) - 1) / 2 for i in range(len(rows))], rows, fontsize=8)
    ax.set(ylabel="this checkout / base (median)", title=f"Weight deltas: this checkout against {base[:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--pairs", type=int, default=2, help="base/head run pairs (each run takes about 2 minutes)")
    parser.add_argument("--out", default="docs/results/weight_delta_ab", help="path stem for the .json")
    parser.add_argument(
        "--same-script",
        action="store_true",
        help="this checkout's benchmark script on both sides (default: each its own)",
    )
    args, bench_args = parser.parse_known_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` removes the worktree
    bench_args = [a for a in bench_args if a != "--"]
    base_sha = subprocess.run(
        ["git", "rev-parse", args.base], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="rljob-ab-") as scratch:
        tree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), base_sha], cwd=REPO, check=True)
        try:
            base_runs, head_runs = [], []
            script = REPO if args.same_script else None
            for i in range(args.pairs):
                # Base first in even pairs, head first in odd ones (base, head, head, base, ...): a
                # drift of the machine over the chain then weighs on both sides alike.
                sides = [("base", tree, base_runs), ("head", REPO, head_runs)]
                for side, where, runs in sides if i % 2 == 0 else sides[::-1]:
                    progress(f"pair {i + 1}/{args.pairs}: {side} ({base_sha[:10] if side == 'base' else 'checkout'})")
                    runs.append(run_bench(where, Path(scratch) / f"{side}_{i}", bench_args, script))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    table = compare(base_runs, head_runs)
    for entry in table:
        gain = f"x{entry['gain']:.2f}" if entry["gain"] else "-"
        base, head = entry["base"], entry["head"]
        progress(f"{entry['row']:<22} {entry['label']:<32} base {base:9.3f}  head {head:9.3f}  {gain}")
    summary = {
        "benchmark": "weight_delta_ab",
        "base": base_sha,
        "pairs": args.pairs,
        "bench_args": bench_args,
        "same_script": args.same_script,
        "load_average": os.getloadavg()[0],
        "table": table,
        "base_runs_full_sync_s": [run["full_sync"]["1"]["latency_s"] for run in base_runs],
        "head_runs_full_sync_s": [run["full_sync"]["1"]["latency_s"] for run in head_runs],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(table, base_sha, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k != "table"}))


if __name__ == "__main__":
    main()
