"""The learning result (issue 7): untrained baseline, warm-up alone, warm-up + GRPO at max policy
lag 0 and 1, all scored greedily on the same first dev.jsonl questions (never trained on).

Every number comes from the project's own entry points: `rljob eval` for the untrained model and
`rljob run FILE --local` (embedded Redis, a rollout worker process, the trainer process) for the
runs, whose trainer evaluates at step 0 (after the warm-up) and at the last step.
  python benchmarks/learning_run.py                      # everything: 73 min on 2 idle CPU cores, plus ~4 min
                                                         # for the untrained baseline unless reused
  python benchmarks/learning_run.py --steps 2 --lags 0   # a shorter run
  python benchmarks/learning_run.py --summarise-only     # rebuild JSON + PNG from finished runs
  python benchmarks/learning_run.py --quick              # smoke: 1 RL step, 4 questions, 8 demonstrations
Interrupted runs resume (`rljob run --resume`) and finished ones are kept, so the command can be run
again after a stop; `--fresh` starts over. Writes docs/results/learning.json and learning.png
(learning-quick.* with --quick), with the paired comparison of warm-up alone and warm-up + RL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _common import RESULTS, finish, progress

MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "rljob-learning.yaml"
KEYS = ("exact_match", "f1", "format_rate", "searches_per_question", "questions")


def variant(manifest: dict, lag: int, args: argparse.Namespace) -> dict:
    """The manifest with this run's policy lag and the command line's overrides."""
    job = json.loads(json.dumps(manifest))
    spec = job["spec"]
    spec["grpo"]["maxPolicyLag"] = lag
    job["metadata"]["name"] = f"learning-lag{lag}"
    if args.quick:
        spec["grpo"]["totalSteps"], spec["eval"]["questions"], spec["warmup"]["examples"] = 1, 4, 8
    if args.steps:
        spec["grpo"]["totalSteps"] = args.steps
    if args.questions:
        spec["eval"]["questions"] = args.questions
    return job


def start(*args: str, log: Path) -> tuple[subprocess.Popen, Path, float]:
    """Start the `rljob` CLI of this interpreter with its output in `log`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rljob.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    return proc, log, time.perf_counter()


def wait(started: tuple[subprocess.Popen, Path, float]) -> float:
    """Wall seconds of a started command; raises when it failed."""
    proc, log, t0 = started
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(proc.args)} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0


def pick(result: dict) -> dict:
    return {k: result[k] for k in KEYS if k in result}


def run_summary(folder: Path) -> dict:
    """What one `rljob run` folder shows: evals, warm-up, steps, timing."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step_seconds")]
    job = yaml.safe_load((folder / "job.yaml").read_text())
    rl_seconds = sum(r["step_seconds"] for r in steps)
    out = {
        "max_policy_lag": job["spec"]["grpo"]["maxPolicyLag"],
        "rl_steps": len(steps),
        "rl_seconds": round(rl_seconds, 1),
        "steps_per_hour": round(3600 * len(steps) / rl_seconds, 2) if rl_seconds else None,
        "mean_wait_seconds": round(sum(r.get("wait_seconds", 0.0) for r in steps) / max(len(steps), 1), 1),
        "mean_train_seconds": round(sum(r.get("train_seconds", 0.0) for r in steps) / max(len(steps), 1), 1),
        "dropped_stale_total": sum(r.get("dropped_stale", 0) for r in steps),
        "train_reward": [round(r.get("mean_reward", 0.0), 4) for r in steps],
        "train_f1": [round(r.get("f1", 0.0), 4) for r in steps],
        "train_format_rate": [round(r.get("format_rate", 0.0), 4) for r in steps],
    }
    for name in ("warmup", "eval_before", "eval_after"):
        path = folder / f"{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            out[name] = {k: v for k, v in data.items() if k != "losses"} if name == "warmup" else pick(data)
            if name == "warmup":
                out["warmup_losses"] = [round(x, 4) for x in data.get("losses", [])]
    return out


def headline(summary: dict, work: Path, lags: list[int], untrained: dict) -> dict:
    """The keys a script checks: paired warm-up-alone vs warm-up+RL on the same dev questions
    (McNemar's exact test on EM, a bootstrap interval on F1), per lag, and lag 1's steps per hour."""
    from rljob.stats import compare_paired

    out: dict = {"untrained_em": untrained.get("exact_match"), "rl_em": {}, "rl_em_gain": {}, "rl_em_p_value": {},
                 "rl_f1_gain": {}, "rl_f1_gain_interval": {}, "rl_steps": {}}  # fmt: skip
    for lag in lags:
        before = json.loads((work / f"lag{lag}" / "eval_before.json").read_text())
        after_path = work / f"lag{lag}" / "eval_after.json"
        if "per_question" not in before or not after_path.exists():
            continue
        paired = compare_paired(before["per_question"], json.loads(after_path.read_text())["per_question"])
        key = f"lag{lag}"
        out["dev_questions"] = paired.questions
        out["warmup_em"] = paired.em_before  # the warm-up is deterministic: the same for every lag
        out["rl_em"][key], out["rl_em_gain"][key] = paired.em_after, paired.em_gain
        out["rl_em_p_value"][key], out["rl_f1_gain"][key] = paired.em_p_value, paired.f1_gain
        out["rl_f1_gain_interval"][key] = list(paired.f1_gain_interval)
        out["rl_steps"][key] = summary["runs"][key]["rl_steps"]
        progress(f"lag {lag}: {paired.line()}")
    runs = summary["runs"]
    if runs.get("lag0", {}).get("steps_per_hour") and runs.get("lag1", {}).get("steps_per_hour"):
        out["lag1_steps_per_hour_ratio"] = runs["lag1"]["steps_per_hour"] / runs["lag0"]["steps_per_hour"]
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = ["untrained"]
    values = {k: [summary["baseline"].get(k, 0.0)] for k in ("exact_match", "f1", "format_rate")}
    first = next(iter(runs.values()), {})
    if "eval_before" in first:
        labels.append("warm-up")
        for k in values:
            values[k].append(first["eval_before"].get(k, 0.0))
    for run in runs.values():
        if "eval_after" in run:
            labels.append(f"warm-up+RL\n(lag {run['max_policy_lag']}, {run['rl_steps']} steps)")
            for k in values:
                values[k].append(run["eval_after"].get(k, 0.0))
    width = 0.27
    for i, (k, vals) in enumerate(values.items()):
        axes[0].bar([x + (i - 1) * width for x in range(len(labels))], vals, width, label=k)
    axes[0].set_xticks(range(len(labels)), labels, fontsize=8)
    axes[0].set_title(f"dev.jsonl, greedy, n={summary['baseline'].get('questions')}")
    axes[0].legend(fontsize=8)
    for name, run in runs.items():
        axes[1].plot(range(1, len(run["train_reward"]) + 1), run["train_reward"], "o-", label=f"{name} reward")
    axes[1].set_xlabel("RL step")
    axes[1].set_title("training reward (F1 + format bonus)")
    axes[1].legend(fontsize=8)
    if "warmup_losses" in first:
        axes[2].plot(range(1, len(first["warmup_losses"]) + 1), first["warmup_losses"])
        axes[2].set_xlabel("warm-up step")
        axes[2].set_title("warm-up loss (written tokens only)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("results/learning"))
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="override grpo.totalSteps")
    parser.add_argument("--questions", type=int, help="override eval.questions (dev questions scored)")
    parser.add_argument("--rerun-baseline", action="store_true", help="score the untrained model again")
    parser.add_argument("--fresh", action="store_true", help="start runs over instead of resuming or keeping them")
    args = parser.parse_args()
    name = "learning-quick" if args.quick else "learning"
    work = args.work / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    manifest = yaml.safe_load(MANIFEST.read_text())
    questions = variant(manifest, 0, args)["spec"]["eval"]["questions"]
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    baseline = work / "baseline.json"
    if not args.summarise_only:
        for lag in args.lags:
            folder = work / f"lag{lag}"
            src = work / f"lag{lag}.yaml"
            job = variant(manifest, lag, args)
            if (folder / "eval_after.json").exists() and not args.fresh:
                progress(f"maxPolicyLag {lag}: finished in {folder}, kept (--fresh runs it again)")
                continue
            resume = (folder / "metrics.jsonl").exists() and src.exists() and not args.fresh
            if resume and yaml.safe_load(src.read_text()) != job:
                raise SystemExit(f"{folder} holds a run of another manifest: pass --fresh to start over")
            if not resume:
                shutil.rmtree(folder, ignore_errors=True)
                src.write_text(yaml.safe_dump(job, sort_keys=False))
            extra = ["--resume"] if resume else []
            progress(
                f"warm-up + GRPO, maxPolicyLag {lag}: rljob run {src} --local --results {folder} {' '.join(extra)}"
            )
            secs = wait(start("run", str(src), "--local", "--results", str(folder), *extra, log=work / f"lag{lag}.log"))
            progress(f"  done in {secs:.0f}s")
        if baseline.exists() and not args.rerun_baseline:
            progress(f"untrained baseline: reusing {baseline}")
        else:
            # After the runs, not beside them: the runs' steps per hour are measured on a machine they have alone.
            base_src = work / "baseline.yaml"
            base_src.write_text(yaml.safe_dump(variant(manifest, 0, args), sort_keys=False))
            progress(f"untrained baseline on the first {questions} dev questions: rljob eval {base_src}")
            base = start("eval", str(base_src), "--limit", str(questions), "--output", str(baseline),
                         log=work / "baseline.log")  # fmt: skip
            progress(f"baseline done in {wait(base):.0f}s")
    done = [lag for lag in args.lags if (work / f"lag{lag}" / "metrics.jsonl").exists()]
    summary = {
        "manifest": str(MANIFEST.relative_to(MANIFEST.parents[1])),
        "baseline": pick(json.loads(baseline.read_text())),
        "runs": {f"lag{lag}": run_summary(work / f"lag{lag}") for lag in done},
    }
    summary.update(headline(summary, work, done, json.loads(baseline.read_text())))
    plot(summary, RESULTS / f"{name}.png")
    finish(name, summary)


if __name__ == "__main__":
    main()
