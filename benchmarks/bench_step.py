"""One GRPO step's work on CPU: rollouts and training, this checkout against a base revision.

Fixed, realistic work: the learning run's agent settings (3 turns, 64 new tokens a turn, 768 in
all, top-2 passages of 30 words, T=0.8) on 8 dev questions x 8 samples (64 trajectories), with
SmolLM2-135M. The end-of-sequence token is taken out of the stop set, so an untrained model's
samples run to a stop string or their budget, and both sides do the same amount of work. Each phase
runs in its own process (its peak RSS is that phase's), at 1 and 2 threads:

- rollout: `generate_groups` on the 64 prompts; generated tokens/s.
- train: one `GRPOTrainer.train_step` on the 64 trajectories this checkout generated (synthetic
  rewards, so every group is informative); trained tokens/s (every position of every row).
- generate: transformers' own `model.generate` on the same first-turn prompts and budget, batched,
  sampling, no stop: the baseline a TRL user gets without vLLM. Compared with this checkout's
  engine on the same single turn.
- roofline: measured GEMM GFLOP/s (at the rows a decode step and a training micro-batch multiply)
  times the model's FLOPs a token.

The base revision (`--base`, default the commit before this work) runs this same script from a
temporary git worktree with its own packages on PYTHONPATH. `--pairs N` runs each side's rollout and
training phases N times, alternated in ABBA order, and takes each speed-up as the median of the
per-pair ratios: this machine's speed drifts by 15-20% within minutes; `--phases rollout` re-measures
the rollouts alone with more pairs. `--step` also times whole GRPO steps at lag 0 and lag 1 through
`rljob run --local` (this checkout only; minutes). Writes <out>.json and <out>.png and prints the
JSON summary as its last line:
  python benchmarks/bench_step.py --pairs 3 --step --out docs/results/step_speed
  python benchmarks/bench_step.py --quick     # tiny work, under a minute, no base, no step
  python benchmarks/bench_step.py --phase rollout --threads 2 --profile   # one phase, per operator
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import inspect
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, finish, progress

REPO = Path(__file__).resolve().parents[1]
BASE = "840733f"  # the last commit before issue 21's changes
AGENT = {
    "maxTurns": 3,
    "topK": 2,
    "maxNewTokensPerTurn": 64,
    "maxTotalTokens": 768,
    "passageMaxWords": 30,
    "temperature": 0.8,
    "reward": "f1",
    "formatReward": 0.1,
    "searchReward": 0.0,
}
QUICK_AGENT = {**AGENT, "maxTurns": 1, "maxNewTokensPerTurn": 8}


# -- phases (run in a child process, with either revision's packages) ---------------------------
def _data_file(name: str) -> Path:
    try:
        from rljob.assets import hotpotqa_file
    except ImportError:  # the base revision reads plain files from RLJOB_DATA_DIR
        from rljob.assets import hotpotqa_dir

        return hotpotqa_dir() / name
    return hotpotqa_file(name)


def _engine(threads: int):
    import torch

    from rljob.assets import smollm2_model_dir
    from rljob.config import ModelSpec
    from rljob.engines.hf import HFEngine

    torch.set_num_threads(threads)
    engine = HFEngine.from_spec(ModelSpec(name=str(smollm2_model_dir())), device="cpu", seed=0)
    engine.eos_ids = set()  # fixed work: samples end at a stop string or their budget
    return engine


def _requests(args):
    from rljob.data.hotpotqa import load_questions
    from rljob.protocol import PromptRequest

    questions = load_questions(_data_file("dev.jsonl"), limit=args.questions)
    return [
        PromptRequest(
            request_id=f"r{i}",
            step=0,
            question_id=q.id,
            question=q.question,
            answers=q.answers,
            group_size=args.group_size,
        )
        for i, q in enumerate(questions)
    ]


def phase_rollout(args) -> dict:
    import torch

    from rljob.agent.rollout import generate_groups
    from rljob.config import AgentSpec
    from rljob.data.hotpotqa import build_corpus, load_questions
    from rljob.retrieval.retriever import Retriever

    engine = _engine(args.threads)
    spec = AgentSpec.model_validate(QUICK_AGENT if args.quick else AGENT)
    corpus = build_corpus(load_questions(_data_file("train.jsonl")) + load_questions(_data_file("dev.jsonl")))
    retriever = Retriever(corpus)
    requests = _requests(args)
    generate_groups(engine, retriever, requests[:1], spec.model_copy(update={"max_turns": 1}))  # warm-up
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    started = time.perf_counter()
    with profiler or contextlib.nullcontext():
        groups = generate_groups(engine, retriever, requests, spec)
    seconds = time.perf_counter() - started
    generated = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
    if args.save_groups:
        Path(args.save_groups).write_text(json.dumps([g.model_dump(mode="json") for g in groups]))
    dtype = str(next(engine.model.parameters()).dtype)
    result = {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds, "dtype": dtype}
    if profiler is not None:
        result["profile"] = operator_times(profiler, seconds)
    return result


def operator_times(profiler, seconds: float, top: int = 8) -> dict:
    """Operators' own time against the wall: what a second thread can divide, and what it cannot.

    The profiler's own per-operator cost lands outside the operators, so `outside_operators_s`
    is an upper bound on the Python and framework time between them."""
    own = {e.key: e.self_cpu_time_total / 1e6 for e in profiler.key_averages()}
    inside = sum(own.values())
    ranked = sorted(own.items(), key=lambda item: -item[1])[:top]
    return {"operators_s": inside, "outside_operators_s": seconds - inside, "top_operators_s": dict(ranked)}


def phase_train(args) -> dict:
    import torch

    from rljob.assets import smollm2_model_dir
    from rljob.config import GRPOSpec, ModelSpec
    from rljob.protocol import TrajectoryGroup
    from rljob.trainer.grpo import GRPOTrainer
    from rljob.trainer.model import load_policy

    torch.set_num_threads(args.threads)
    groups = [TrajectoryGroup.model_validate(g) for g in json.loads(Path(args.groups).read_text())]
    for g in groups:  # synthetic rewards: every group informative, as the speed is what is measured
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    spec = GRPOSpec(group_size=args.group_size, questions_per_step=len(groups), micro_batch_size=4)
    kwargs = {"temperature": AGENT["temperature"]}
    if "compute_dtype" in inspect.signature(GRPOTrainer).parameters:
        from rljob.precision import compute_dtype

        kwargs["compute_dtype"] = compute_dtype(ModelSpec().dtype, "cpu")
    trainer = GRPOTrainer(load_policy(ModelSpec(name=str(smollm2_model_dir()))), None, spec, **kwargs)
    started = time.perf_counter()
    stats = trainer.train_step(groups, 0)
    seconds = time.perf_counter() - started
    tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
    autocast = str(kwargs.get("compute_dtype", "none"))
    return {
        "seconds": seconds,
        "tokens": tokens,
        "loss_tokens": stats.tokens,
        "tokens_per_s": tokens / seconds,
        "importance_weight": stats.importance_weight,
        "autocast": autocast,
    }


def phase_generate(args) -> dict:
    """transformers' model.generate against this engine, one turn, same prompts, same budget."""
    import torch

    from rljob.agent.prompt import prompt_ids
    from rljob.engines.base import TurnParams

    engine = _engine(args.threads)
    budget = QUICK_AGENT["maxNewTokensPerTurn"] if args.quick else AGENT["maxNewTokensPerTurn"]
    contexts = [prompt_ids(engine.tokenizer, r.question) for r in _requests(args) for _ in range(r.group_size)]
    params = TurnParams(max_new_tokens=[budget] * len(contexts), temperature=AGENT["temperature"])
    engine.generate(contexts[:2], TurnParams(max_new_tokens=[2, 2], temperature=1.0))  # warm-up
    started = time.perf_counter()
    ours = sum(len(o.token_ids) for o in engine.generate(contexts, params))
    ours_s = time.perf_counter() - started
    # transformers as a TRL user gets it: a model of its own, its default attention and cache
    from rljob.assets import smollm2_model_dir
    from rljob.config import ModelSpec
    from rljob.engines.models import load_model

    model, width = load_model(ModelSpec(name=str(smollm2_model_dir()))), max(len(c) for c in contexts)
    pad = engine.pad_id
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    model.generation_config.pad_token_id = pad
    with torch.inference_mode():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=True)  # warm-up
        started = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=budget,
            min_new_tokens=budget,
            do_sample=True,
            temperature=AGENT["temperature"],
            top_p=1.0,
            top_k=0,
        )
        hf_s = time.perf_counter() - started
    hf = int((out.shape[1] - width) * len(contexts))
    return {
        "engine_tokens_per_s": ours / ours_s,
        "generate_tokens_per_s": hf / hf_s,
        "engine_seconds": ours_s,
        "generate_seconds": hf_s,
        "rows": len(contexts),
    }


def phase_roofline(args) -> dict:
    """GEMM GFLOP/s at the shapes the model multiplies, and the model's FLOPs a token."""
    import torch

    from rljob.assets import smollm2_model_dir
    from rljob.config import ModelSpec
    from rljob.trainer.model import load_policy

    torch.set_num_threads(args.threads)
    model = load_policy(ModelSpec(name=str(smollm2_model_dir())))
    config = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    head = config.hidden_size * config.vocab_size
    out = {"body_flops_per_token": 2 * body, "head_flops_per_token": 2 * head}

    def gflops(rows: int, dtype) -> float:
        a = torch.randn(rows, config.hidden_size, dtype=dtype)
        w = torch.randn(config.intermediate_size, config.hidden_size, dtype=dtype)
        torch.nn.functional.linear(a, w)
        reps, started = 0, time.perf_counter()
        while time.perf_counter() - started < 0.5:
            torch.nn.functional.linear(a, w)
            reps += 1
        return 2 * rows * config.hidden_size * config.intermediate_size * reps / (time.perf_counter() - started) / 1e9

    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"gemm_decode_gflops_{name}"] = gflops(64, dtype)  # a 64-row decode step
        out[f"gemm_train_gflops_{name}"] = gflops(2048, dtype)  # a micro-batch's rows
    return out


def phase_main(args) -> None:
    phase = {"rollout": phase_rollout, "train": phase_train, "generate": phase_generate, "roofline": phase_roofline}[
        args.phase
    ]
    result = phase(args)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result), flush=True)


# -- driver ---------------------------------------------------------------------------------------
def run_phase(tree: Path, phase: str, threads: int, args, extra: list[str] = (), data_dir: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "workers"), str(tree / "operator")]))
    if data_dir is not None:
        env["RLJOB_DATA_DIR"] = str(data_dir)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--phase",
        phase,
        "--threads",
        str(threads),
        "--questions",
        str(args.questions),
        "--group-size",
        str(args.group_size),
        *extra,
    ]
    if args.quick:
        command.append("--quick")
    done = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(rows: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every run's rate."""
    ordered = sorted(rows, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in rows]}


def plain_sample(folder: Path) -> Path:
    """The packaged sample decompressed, for a base revision that reads plain files only."""
    from rljob.assets import hotpotqa_file

    for name in ("train.jsonl", "dev.jsonl"):
        with gzip.open(hotpotqa_file(name), "rb") as src, open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return folder


def step_seconds(lag: int, args, scratch: Path) -> dict:
    """Whole GRPO steps through `rljob run --local` at `maxPolicyLag: lag` (this checkout)."""
    import yaml

    manifest = yaml.safe_load((REPO / "examples" / "rljob-learning.yaml").read_text())
    spec = manifest["spec"]
    spec["agent"] = AGENT
    # A short warm-up, so the untrained model follows the protocol and its groups carry signal:
    # steps of all-equal rewards train on nothing and would time only the rollouts.
    spec["warmup"].update(enabled=args.step_warmup > 0, examples=max(args.step_warmup, 1), batchSize=4)
    spec["grpo"].update(
        questionsPerStep=args.questions,
        groupSize=args.group_size,
        totalSteps=args.steps,
        maxPolicyLag=lag,
        microBatchSize=4,
    )
    spec["rollout"]["batchSize"] = args.questions
    spec["eval"] = {"interval": 0, "questions": 1}
    spec["agent"]["reward"] = "f1"
    path = scratch / f"lag{lag}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    results = scratch / f"lag{lag}"
    rljob = shutil.which("rljob") or str(Path(sys.executable).parent / "rljob")
    started = time.perf_counter()
    run = subprocess.run(
        [rljob, "run", str(path), "--local", "--results", str(results)], cwd=REPO, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"rljob run failed:\n{run.stderr[-3000:]}")
    rows = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_seconds" in r]
    steady = rows[1:] or rows  # the first step also waits for the workers to load
    trained = sum(bool(r.get("train_updated")) for r in steady)
    per_step = statistics.median(r["step_seconds"] for r in steady)
    return {
        "lag": lag,
        "steps": len(rows),
        "step_seconds": per_step,
        "wall_seconds": wall,
        "rollout_wait_s": statistics.median(r.get("wait_seconds", 0.0) for r in steady),
        "train_s": statistics.median(r.get("train_seconds", 0.0) for r in steady),
        "steps_that_trained": trained,
        "steady_steps": len(steady),
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"rollout": "generated tokens/s", "train": "trained tokens/s"}
    kinds = [kind for kind in titles if f"{kind}_{summary['threads'][0]}" in summary["head"]]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        labels, base, head = [], [], []
        for threads in summary["threads"]:
            labels.append(f"{threads} thread{'s' if threads > 1 else ''}")
            head.append(summary["head"][f"{kind}_{threads}"]["tokens_per_s"])
            base.append(summary["base"].get(f"{kind}_{threads}", {}).get("tokens_per_s", 0.0))
        xs = range(len(labels))
        if summary["base_revision"]:
            ax.bar([x - 0.2 for x in xs], base, 0.4, color="tab:blue", label=f"before ({summary['base_revision']})")
        ax.bar([x + 0.2 for x in xs], head, 0.4, color="tab:orange", label="this checkout")
        ax.set_xlim(-0.5, len(labels) - 0.5)
        for x, threads in zip(xs, summary["threads"], strict=True):
            top = head[x]
            for side, offset in (("base", -0.2), ("head", 0.2)):
                runs = summary[side].get(f"{kind}_{threads}", {}).get("runs_tokens_per_s", [])
                ax.scatter([x + offset] * len(runs), runs, s=12, color="dimgray", zorder=3)
                top = max([top, *runs])
            ratio = summary.get("speedups_by_threads", {}).get(str(threads), {}).get(kind)
            if ratio:
                ax.annotate(
                    f"{ratio:.2f}x", (x + 0.2, top), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=9
                )
        if kind == "rollout":
            gen = [summary["head"][f"generate_{t}"]["generate_tokens_per_s"] for t in summary["threads"]]
            ax.scatter(list(xs), gen, color="black", marker="D", zorder=3, label="model.generate (1 turn)")
        ax.set_xticks(list(xs), labels)
        ax.set_ylim(top=1.4 * max(head + base))  # room for the legend above the bars
        ax.set_title(f"{titles[kind]} (dots: each run; label: median pair's ratio)", fontsize=10)
        ax.legend(loc="upper left")
    fig.suptitle(f"GRPO step work, {summary['questions']} questions x {summary['group_size']} samples, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 questions x 2 samples, 1 turn of 8 tokens, no base")
    parser.add_argument("--base", default=BASE, help="revision to compare with ('' to skip)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads-list", default="1,2")
    parser.add_argument(
        "--pairs", type=int, default=1, help="runs of each side per phase, alternated; speed-ups are the median pair's"
    )
    parser.add_argument(
        "--phases", default="rollout,train", help="paired phases: rollout,train or rollout (to re-measure it alone)"
    )
    parser.add_argument("--step", action="store_true", help="also time whole steps at lag 0 and 1 (rljob run)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per lag with --step")
    parser.add_argument("--step-warmup", type=int, default=24, help="warm-up demonstrations before the --step runs")
    parser.add_argument("--only-step", action="store_true", help="add --step figures to the existing --out JSON")
    parser.add_argument("--out", default=None, help="output path without suffix (default docs/results/step_speed)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", action="store_true", help="with --phase rollout: operators' own time under torch.profiler"
    )
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--save-groups", help=argparse.SUPPRESS)
    parser.add_argument("--groups", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile and args.phase != "rollout":
        parser.error("--profile profiles one rollout phase: add --phase rollout --threads N")
    if args.phase:
        return phase_main(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` removes the base's worktree
    if args.quick:
        args.questions, args.group_size, args.base, args.threads_list = 2, 2, "", "2"
    threads_list = [int(t) for t in args.threads_list.split(",")]
    phases = args.phases.split(",")
    if phases not in (["rollout"], ["rollout", "train"]):
        parser.error("--phases is rollout,train or rollout (training trains on the rollouts' trajectories)")
    out = Path(args.out) if args.out else RESULTS / ("step_speed_quick" if args.quick else "step_speed")
    if args.only_step:
        summary = json.loads(out.with_suffix(".json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            for lag in (0, 1):
                progress(f"rljob run --local, lag {lag}, {args.steps} steps")
                summary[f"step_lag{lag}"] = step_seconds(lag, args, Path(tmp))
                progress(f"  {summary[f'step_lag{lag}']}")
        summary["step_seconds_lag0"] = summary["step_lag0"]["step_seconds"]
        summary["step_seconds_lag1"] = summary["step_lag1"]["step_seconds"]
        plot(summary, out.with_suffix(".png"))
        return finish(out.name, summary, out.parent)
    summary: dict = {
        "questions": args.questions,
        "group_size": args.group_size,
        "threads": threads_list,
        "base_revision": args.base,
        "head": {},
        "base": {},
        "pairs": args.pairs,
        "pair_ratios": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        groups = scratch / "groups.json"
        tree = scratch / "base"
        if args.base:
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tree), args.base], cwd=REPO, check=True, capture_output=True
            )
        try:
            data = plain_sample(Path(tempfile.mkdtemp(dir=scratch))) if args.base else None
            for threads in threads_list:
                for phase in phases:
                    runs: dict[str, list[dict]] = {"head": [], "base": []}
                    for pair in range(args.pairs):
                        # ABBA order: a drift during the run weighs on both sides alike
                        sides = ["head", "base"] if pair % 2 == 0 else ["base", "head"]
                        for side in sides if args.base else ["head"]:
                            first_rollout = phase == "rollout" and side == "head" and not runs["head"]
                            extra = ["--save-groups" if first_rollout else "--groups", str(groups)]
                            progress(f"{side}, {threads} thread(s): {phase}, pair {pair + 1}/{args.pairs}")
                            if side == "head":
                                runs[side].append(run_phase(REPO, phase, threads, args, extra))
                            else:
                                runs[side].append(run_phase(tree, phase, threads, args, extra, data_dir=data))
                            progress(f"  {runs[side][-1]}")
                    for side, rows in runs.items():
                        if rows:
                            summary[side][f"{phase}_{threads}"] = median_run(rows)
                    if args.base:
                        ratios = [h["tokens_per_s"] / b["tokens_per_s"] for h, b in zip(*runs.values(), strict=True)]
                        summary["pair_ratios"].setdefault(str(threads), {})[phase] = ratios
                for phase in ("generate", "roofline"):
                    progress(f"this checkout, {threads} thread(s): {phase}")
                    row = run_phase(REPO, phase, threads, args, ["--groups", str(groups)])
                    summary["head"][f"{phase}_{threads}"] = row
                    progress(f"  {row}")
        finally:
            if args.base:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
        if args.step:
            for lag in (0, 1):
                progress(f"rljob run --local, lag {lag}, {args.steps} steps")
                summary[f"step_lag{lag}"] = step_seconds(lag, args, scratch)
                progress(f"  {summary[f'step_lag{lag}']}")

    head, base, best = summary["head"], summary["base"], max(threads_list)
    roof = head[f"roofline_{best}"]
    decode_roof = roof["gemm_decode_gflops_bf16"] * 1e9 / (roof["body_flops_per_token"] + roof["head_flops_per_token"])
    train_roof = roof["gemm_train_gflops_bf16"] * 1e9 / (3 * roof["body_flops_per_token"])
    ceilings = {"rollout": decode_roof, "train": train_roof}
    summary["generate_speedup"] = (
        head[f"generate_{best}"]["engine_tokens_per_s"] / head[f"generate_{best}"]["generate_tokens_per_s"]
    )
    summary["roofline_fraction"] = {}
    for phase in phases:
        summary[f"{phase}_tokens_per_s"] = head[f"{phase}_{best}"]["tokens_per_s"]
        summary["roofline_fraction"][phase] = summary[f"{phase}_tokens_per_s"] / ceilings[phase]
    if base:
        summary["speedups_by_threads"] = {
            t: {k: statistics.median(summary["pair_ratios"][str(t)][k]) for k in phases} for t in threads_list
        }
        for phase in phases:
            summary[f"{phase}_speedup"] = summary["speedups_by_threads"][best][phase]
    if args.step:
        summary["step_seconds_lag0"] = summary["step_lag0"]["step_seconds"]
        summary["step_seconds_lag1"] = summary["step_lag1"]["step_seconds"]
    process = {"rollout": "rollout_worker", "train": "trainer"}
    summary["peak_rss_mb"] = {process[phase]: head[f"{phase}_{best}"]["peak_rss_mb"] for phase in phases}
    plot(summary, out.with_suffix(".png"))
    finish(out.name, summary, out.parent)


if __name__ == "__main__":
    main()
