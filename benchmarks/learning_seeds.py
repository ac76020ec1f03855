"""Replicates of the learning run (issue 22), pooled: does the recipe's EM gain hold across seeds?

Reads finished runs of `learning_run.py` (the recipe at `data.seed` 0 in `full/`, other seeds in
`full-NAME/`), pairs each run's warm-up-alone and final evaluations on the same dev questions, and
reports per seed (McNemar's exact test) and pooled: each question's gain averaged over the seeds,
with a bootstrap interval and a sign-flip test over questions. Nothing is run; it takes seconds.
  python benchmarks/learning_seeds.py            # lag 0: docs/results/learning_seeds.json and .png
  python benchmarks/learning_seeds.py --lag 1
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import yaml
from _common import RESULTS, finish, progress
from learning_run import _per_question, run_summary

from rljob.stats import compare_paired, compare_replicated


def replicate_folders(work: Path, lag: int) -> dict[int, Path]:
    """Finished dev runs of the recipe at this lag, by data.seed (validation variants excluded)."""
    found: dict[int, Path] = {}
    for folder in sorted([work / "full", *work.glob("full-*")]):
        run = folder / f"lag{lag}"
        if not (run / "eval_after.json").exists():
            continue
        seed = yaml.safe_load((run / "job.yaml").read_text())["spec"]["data"].get("seed", 0)
        if seed in found:
            raise SystemExit(f"{found[seed]} and {run} are both seed {seed}: keep one")
        found[seed] = run
    return found


def plot(per_seed: dict, rewards: dict, pooled: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (scores, reward) = plt.subplots(1, 2, figsize=(13, 4.5))
    seeds = list(per_seed)
    for i, (metric, label) in enumerate((("em", "EM"), ("f1", "F1"))):
        for j, when in enumerate(("before", "after")):
            x = [k + (2 * i + j - 1.5) * 0.2 for k in range(len(seeds))]
            values = [per_seed[s][f"{metric}_{when}"] for s in seeds]
            scores.bar(x, values, 0.2, label=f"{label} {'warm-up alone' if when == 'before' else 'warm-up + RL'}")
    scores.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    scores.set_title(
        f"dev, greedy, n={pooled['questions']}: EM gain {pooled['em_gain']:+.3f} pooled "
        f"(p={pooled['em_p_value']:.2g}), F1 {pooled['f1_gain']:+.3f}",
        fontsize=9,
    )
    scores.legend(fontsize=8)
    for seed, values in rewards.items():
        reward.plot(range(1, len(values) + 1), values, "o-", ms=3, label=f"seed {seed}")
    reward.set_title("training reward (F1 + format bonus), mean of the step's samples", fontsize=9)
    reward.set_xlabel("RL step")
    reward.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=RESULTS / "learning_runs")
    parser.add_argument("--lag", type=int, default=0)
    args = parser.parse_args()
    folders = replicate_folders(args.work, args.lag)
    if not folders:
        raise SystemExit(f"no finished lag-{args.lag} run under {args.work}: run benchmarks/learning_run.py first")
    pairs, per_seed, rewards = [], {}, {}
    for seed, folder in sorted(folders.items()):
        before, after = _per_question(folder, "eval_before"), _per_question(folder, "eval_after")
        paired = compare_paired(before, after)
        progress(f"seed {seed} ({folder.relative_to(args.work)}): {paired.line()}")
        pairs.append((before, after))
        per_seed[seed] = {"folder": str(folder.relative_to(RESULTS)), **asdict(paired)}
        rewards[seed] = run_summary(folder)["train_reward"]
    pooled = compare_replicated(pairs)
    progress(f"pooled: {pooled.line()}")
    summary = {"max_policy_lag": args.lag, "seeds": per_seed, "train_reward": rewards, "pooled": asdict(pooled)}
    plot(
        {s: {k: v for k, v in p.items() if k.endswith(("before", "after"))} for s, p in per_seed.items()},
        rewards,
        summary["pooled"],
        RESULTS / ("learning_seeds.png" if args.lag == 0 else f"learning_seeds_lag{args.lag}.png"),
    )
    finish("learning_seeds" if args.lag == 0 else f"learning_seeds_lag{args.lag}", json.loads(json.dumps(summary)))


if __name__ == "__main__":
    main()
