"""The learning result (issue 22): untrained, warm-up alone, warm-up + GRPO at max policy lag 0 and 1,
all scored greedily on the same dev.jsonl questions (never trained on), paired.

Every number comes from the project's own entry points: `rljob eval` for the untrained model and
`rljob run FILE --local` (embedded Redis, a rollout worker process, the trainer process) for the
runs, whose trainer evaluates at step 0 (after the warm-up), every eval.interval steps and at the end.
  python benchmarks/learning_run.py                      # everything on dev (about 2 h on 2 idle CPU cores)
  python benchmarks/learning_run.py --split validation --lags 1 --set grpo.learningRate=3e-5 --name lr3e-5
                                                         # choosing settings: scored on the validation slice
  python benchmarks/learning_run.py --lags 0 --set data.seed=1 --name seed1
                                                         # a replicate on dev: learning_seed1.*, full-seed1/
  python benchmarks/learning_run.py --summarise-only     # rebuild JSON + PNG from finished runs
  python benchmarks/learning_run.py --quick              # smoke: 1 RL step, 4 questions, 8 demonstrations
Interrupted runs resume (`rljob run --resume`) and finished ones are kept, so the command can be run
again after a stop; `--fresh` starts over. Writes docs/results/learning.json and learning.png
(learning_validation_NAME.* with --split validation, learning-quick.* with --quick).
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
KEYS = ("exact_match", "f1", "format_rate", "searches_per_question", "questions", "step")


def variant(manifest: dict, lag: int, args: argparse.Namespace) -> dict:
    """The manifest with this run's policy lag and the command line's overrides."""
    job = json.loads(json.dumps(manifest))
    spec = job["spec"]
    spec["grpo"]["maxPolicyLag"] = lag
    job["metadata"]["name"] = f"learning-lag{lag}"
    for assignment in args.set:
        dotted, _, value = assignment.partition("=")
        *path, leaf = dotted.split(".")
        node = spec
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    if args.split == "validation":
        spec["eval"]["split"], spec["eval"]["questions"] = "validation", spec["data"]["validationQuestions"]
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
    """What one `rljob run` folder shows: evals (with the RL seconds spent when each was taken),
    warm-up, steps, timing, informative groups."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step_seconds")]
    job = yaml.safe_load((folder / "job.yaml").read_text())
    rl_seconds = sum(r["step_seconds"] for r in steps)
    elapsed, total = {0: 0.0}, 0.0
    for r in steps:
        total += r["step_seconds"]
        elapsed[r["step"]] = total
    out = {
        "max_policy_lag": job["spec"]["grpo"]["maxPolicyLag"],
        "grpo": job["spec"]["grpo"],  # as the run had it (job.yaml), whatever the manifest says now
        "rl_steps": len(steps),
        "rl_seconds": round(rl_seconds, 1),
        "steps_per_hour": round(3600 * len(steps) / rl_seconds, 2) if rl_seconds else None,
        "mean_wait_seconds": round(sum(r.get("wait_seconds", 0.0) for r in steps) / max(len(steps), 1), 1),
        "mean_train_seconds": round(sum(r.get("train_seconds", 0.0) for r in steps) / max(len(steps), 1), 1),
        "dropped_stale_total": sum(r.get("dropped_stale", 0) for r in steps),
        "groups_generated_total": sum(r.get("groups_generated", 0) for r in steps),
        "groups_informative_total": sum(r.get("groups_informative", 0) for r in steps),
        "train_reward": [round(r.get("mean_reward", 0.0), 4) for r in steps],
        "train_f1": [round(r.get("f1", 0.0), 4) for r in steps],
        "train_format_rate": [round(r.get("format_rate", 0.0), 4) for r in steps],
        "informative_group_rate": [round(r.get("informative_group_rate", 0.0), 3) for r in steps],
        "step_seconds": [round(r["step_seconds"], 1) for r in steps],
        "evals": [],
    }
    for path in [folder / "eval_before.json", *sorted(folder.glob("eval_step*.json"), key=_step_of)]:
        if path.exists():
            step = 0 if path.name == "eval_before.json" else _step_of(path)
            seconds = elapsed.get(step)
            out["evals"].append(
                {
                    "step": step,
                    "rl_seconds": None if seconds is None else round(seconds, 1),
                    **pick(json.loads(path.read_text())),
                }
            )
    for name in ("warmup", "eval_before", "eval_after"):
        path = _eval_path(folder, name)
        if path.exists():
            data = json.loads(path.read_text())
            out[name] = {k: v for k, v in data.items() if k != "losses"} if name == "warmup" else pick(data)
            if name == "warmup":
                out["warmup_losses"] = [round(x, 4) for x in data.get("losses", [])]
    return out


def _step_of(path: Path) -> int:
    return int(path.stem.removeprefix("eval_step"))


def _eval_path(folder: Path, name: str) -> Path:
    """The file of evaluation `name`; "eval_after" of a run stopped early is its last evaluation."""
    if name == "eval_after" and not (folder / "eval_after.json").exists():
        steps = sorted(folder.glob("eval_step*.json"), key=_step_of)
        if steps:
            return steps[-1]
    return folder / f"{name}.json"


def _per_question(folder: Path, name: str) -> list | None:
    path = _eval_path(folder, name)
    return json.loads(path.read_text()).get("per_question") if path.exists() else None


def headline(summary: dict, work: Path, lags: list[int], untrained: dict) -> dict:
    """The keys a script checks: paired warm-up-alone vs warm-up+RL on the same questions
    (McNemar's exact test on EM, a bootstrap interval on F1), per lag; lag 1's steps per hour over
    lag 0's; lag 1 vs lag 0 paired at equal steps, and at the evaluation nearest equal RL time."""
    from rljob.stats import compare_paired

    out: dict = {
        "untrained_em": untrained.get("exact_match"),
        "untrained_f1": untrained.get("f1"),
        "rl_em": {},
        "rl_f1": {},
        "rl_em_gain": {},
        "rl_em_p_value": {},
        "rl_em_gained_lost": {},
        "rl_f1_gain": {},
        "rl_f1_gain_interval": {},
        "rl_steps": {},
    }
    for lag in lags:
        before, after = (
            _per_question(work / f"lag{lag}", "eval_before"),
            _per_question(work / f"lag{lag}", "eval_after"),
        )
        if not before or not after:
            continue
        paired = compare_paired(before, after)
        key = f"lag{lag}"
        out["dev_questions"] = paired.questions
        out["warmup_em"], out["warmup_f1"] = paired.em_before, paired.f1_before  # deterministic: the same per lag
        out["rl_em"][key], out["rl_f1"][key], out["rl_em_gain"][key] = paired.em_after, paired.f1_after, paired.em_gain
        out["rl_em_p_value"][key], out["rl_f1_gain"][key] = paired.em_p_value, paired.f1_gain
        out["rl_em_gained_lost"][key] = [paired.em_gained, paired.em_lost]
        out["rl_f1_gain_interval"][key] = list(paired.f1_gain_interval)
        out["rl_steps"][key] = summary["runs"][key]["eval_after"]["step"]  # of the scored weights
        progress(f"lag {lag}: {paired.line()}")
    runs = summary["runs"]
    if runs.get("lag0", {}).get("steps_per_hour") and runs.get("lag1", {}).get("steps_per_hour"):
        out["lag1_steps_per_hour_ratio"] = round(runs["lag1"]["steps_per_hour"] / runs["lag0"]["steps_per_hour"], 3)
        lag0, lag1 = _per_question(work / "lag0", "eval_after"), _per_question(work / "lag1", "eval_after")
        if lag0 and lag1 and runs["lag0"]["rl_steps"] == runs["lag1"]["rl_steps"]:
            same = compare_paired(lag0, lag1)  # "before" = lag 0, "after" = lag 1
            out["lag1_vs_lag0_equal_steps"] = _paired_dict(same)
            progress(f"lag 1 vs lag 0 at {runs['lag1']['rl_steps']} steps: {same.line()}")
        end = runs["lag1"]["rl_seconds"]
        timed = [e for e in runs["lag0"]["evals"] if e["rl_seconds"] is not None]
        if timed:
            nearest = min(timed, key=lambda e: abs(e["rl_seconds"] - end))
            name = "eval_before" if nearest["step"] == 0 else f"eval_step{nearest['step']}"
            lag0_then = _per_question(work / "lag0", name)
            if lag0_then and lag1:
                then = compare_paired(lag0_then, lag1)
                out["lag1_vs_lag0_equal_time"] = {
                    "lag1_step": runs["lag1"]["rl_steps"],
                    "lag1_rl_seconds": end,
                    "lag0_step": nearest["step"],
                    "lag0_rl_seconds": nearest["rl_seconds"],
                    **_paired_dict(then),
                }
                progress(f"lag 1 after {end:.0f} s vs lag 0 after {nearest['rl_seconds']:.0f} s: {then.line()}")
    return out


def _paired_dict(paired) -> dict:
    return {
        "em_lag0": paired.em_before,
        "em_lag1": paired.em_after,
        "em_difference": paired.em_gain,
        "em_p_value": paired.em_p_value,
        "f1_difference": paired.f1_gain,
        "f1_difference_interval": list(paired.f1_gain_interval),
        "questions": paired.questions,
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (bars, reward, informative), (em_steps, em_time, step_time) = axes
    labels = ["untrained"]
    values = {k: [summary["baseline"].get(k, 0.0)] for k in ("exact_match", "f1", "format_rate")}
    first = next(iter(runs.values()), {})
    if "eval_before" in first:
        labels.append("warm-up")
        for k in values:
            values[k].append(first["eval_before"].get(k, 0.0))
    for run in runs.values():
        if "eval_after" in run:
            labels.append(f"warm-up+RL\n(lag {run['max_policy_lag']}, {run['eval_after']['step']} steps)")
            for k in values:
                values[k].append(run["eval_after"].get(k, 0.0))
    width = 0.27
    for i, (k, vals) in enumerate(values.items()):
        bars.bar([x + (i - 1) * width for x in range(len(labels))], vals, width, label=k)
    bars.set_xticks(range(len(labels)), labels, fontsize=8)
    bars.set_title(f"{summary['scored']}, greedy, n={first.get('eval_before', {}).get('questions')}")
    bars.legend(fontsize=8)
    for name, run in runs.items():
        x = range(1, len(run["train_reward"]) + 1)
        reward.plot(x, run["train_reward"], "o-", ms=3, label=f"{name}")
        informative.plot(x, run["informative_group_rate"], "o-", ms=3, label=name)
        step_time.plot(x, run["step_seconds"], "o-", ms=3, label=name)
        evals = run["evals"]
        for metric, style in (("exact_match", "o-"), ("f1", "s--")):
            em_steps.plot([e["step"] for e in evals], [e[metric] for e in evals], style, label=f"{name} {metric}")
            timed = [e for e in evals if e["rl_seconds"] is not None]
            em_time.plot(
                [e["rl_seconds"] / 60 for e in timed], [e[metric] for e in timed], style, label=f"{name} {metric}"
            )
    for ax, title, xlabel in (
        (reward, "training reward (F1 + format bonus), mean of the step's samples", "RL step"),
        (informative, "informative groups / groups generated", "RL step"),
        (em_steps, f"{summary['scored']} EM and F1 by step", "RL step"),
        (em_time, f"{summary['scored']} EM and F1 by RL wall time", "minutes of RL (evaluations excluded)"),
        (step_time, "step time (s)", "RL step"),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--work", type=Path, default=RESULTS / "learning_runs")
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="override grpo.totalSteps")
    parser.add_argument("--questions", type=int, help="override eval.questions (dev questions scored)")
    parser.add_argument(
        "--split",
        choices=["eval", "validation"],
        default="eval",
        help="score dev.jsonl (eval), or the validation slice while choosing settings",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. grpo.learningRate=3e-5 (YAML value)",
    )
    parser.add_argument("--name", default="base", help="label of a variant: --split validation, or a replicate on dev")
    parser.add_argument("--rerun-baseline", action="store_true", help="score the untrained model again")
    parser.add_argument("--fresh", action="store_true", help="start runs over instead of resuming or keeping them")
    args = parser.parse_args()
    if args.quick:
        name, folder = "learning-quick", "quick"
    elif args.split == "validation":
        name, folder = f"learning_validation_{args.name}", f"validation-{args.name}"
    elif args.name != "base":  # a replicate of the recipe on dev (another seed, say): its own files
        name, folder = f"learning_{args.name}", f"full-{args.name}"
    else:
        name, folder = "learning", "full"
    work = args.work / folder
    work.mkdir(parents=True, exist_ok=True)
    manifest = yaml.safe_load(MANIFEST.read_text())
    questions = variant(manifest, 0, args)["spec"]["eval"]["questions"]
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # The untrained model's score depends on the questions and the agent settings only.
    baseline = args.work / ("baseline-quick.json" if args.quick else f"baseline-{args.split}.json")
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
            which = ["--split", "validation"] if args.split == "validation" else ["--limit", str(questions)]
            progress(f"untrained baseline on {questions} questions ({args.split}): rljob eval {base_src}")
            base = start("eval", str(base_src), *which, "--output", str(baseline), log=work / "baseline.log")
            progress(f"baseline done in {wait(base):.0f}s")
    done = [lag for lag in args.lags if (work / f"lag{lag}" / "metrics.jsonl").exists()]
    summary = {
        "manifest": str(MANIFEST.relative_to(MANIFEST.parents[1])),
        "scored": "validation slice" if args.split == "validation" else "dev.jsonl",
        "baseline": pick(json.loads(baseline.read_text())) if baseline.exists() else {},
        "runs": {f"lag{lag}": run_summary(work / f"lag{lag}") for lag in done},
    }
    summary.update(headline(summary, work, done, summary["baseline"]))
    plot(summary, RESULTS / f"{name}.png")
    finish(name, summary)


if __name__ == "__main__":
    main()
