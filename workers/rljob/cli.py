"""The `rljob` command: local runs, and the entry points of the rollout and trainer pods."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rljob.config import RLJob
    from rljob.runtime_env import WorkerEnv


class BadInput(Exception):
    """Input the user can fix (a missing, unreadable or invalid manifest or path): `main` prints it
    on stderr and exits 2, without a traceback. Raised only before any model or data is loaded."""


def load_job(path: str) -> RLJob:
    """The manifest at `path`, validated and with `bundled:` references resolved, or BadInput.

    One place for every subcommand, so a directory, a YAML syntax error, a schema error or a
    missing data file reads the same everywhere.
    """
    import yaml
    from pydantic import ValidationError

    from rljob.config import load_rljob
    from rljob.runtime_env import resolve_bundled

    try:
        return resolve_bundled(load_rljob(path))
    except OSError as exc:
        where = exc.filename if exc.filename is not None else path
        raise BadInput(f"{where}: {exc.strerror}" if exc.strerror else f"{path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise BadInput(f"{path} is not valid YAML: {exc}") from exc
    except ValidationError as exc:
        raise BadInput(f"{path}: {exc}") from exc
    except ValueError as exc:  # load_rljob's own messages start with the path
        raise BadInput(str(exc) if str(exc).startswith(path) else f"{path}: {exc}") from exc


def _pod_job() -> tuple[WorkerEnv, RLJob]:
    """The pod's RLJOB_* settings and the job they name; a missing variable is bad input like a bad manifest."""
    from rljob.runtime_env import WorkerEnv

    try:
        env = WorkerEnv.from_environ()
    except SystemExit as exc:  # from_environ's message for missing variables
        raise BadInput(str(exc.code)) from None
    return env, load_job(env.config_path)


def _has_checkpoint(path: Path) -> bool:
    """A step directory or a folder of them (rljob.trainer.checkpoint's layout, checked without torch)."""
    if (path / "state.pt").is_file():
        return True
    return any(c.is_dir() and c.name.startswith("step-") and (c / "meta.json").is_file() for c in path.iterdir())


def _check_results_folder(results: Path, job: RLJob, *, resume: bool) -> None:
    """A results folder the run can write; a run already there is resumed only when asked, and only
    under the manifest it was started with."""
    started = results.is_dir() and any((results / name).exists() for name in ("checkpoints", "redis", "job.yaml"))
    if started and not resume:
        raise BadInput(
            f"--results {results}: holds an earlier run; add --resume to go on with it, or pick a new folder"
        )
    if resume and not started:
        raise BadInput(f"--resume: {results} holds no earlier run to resume")
    if started:
        import yaml

        from rljob.config import RLJob

        saved = results / "job.yaml"
        try:
            earlier = RLJob.model_validate(yaml.safe_load(saved.read_text()))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise BadInput(f"--resume: {saved} is unreadable ({exc})") from exc
        if earlier.spec != job.spec:
            raise BadInput(f"--resume: the manifest differs from the one {results} was started with ({saved})")
    try:
        results.mkdir(parents=True, exist_ok=True)
        probe = results / ".rljob-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"--results {results}: cannot write there ({exc.strerror or exc})") from exc


def cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        raise BadInput("needs --local (on a cluster: helm install the operator and kubectl apply -f FILE)")
    if args.workers < 1:
        raise BadInput(f"--workers must be at least 1, not {args.workers}")
    job = load_job(args.file)
    from rljob.embedded_redis import RedisNotInstalled, find_redis_server
    from rljob.local_run import LocalRun, LocalRunFailed, summarise

    try:
        find_redis_server()
    except RedisNotInstalled as exc:
        raise BadInput(str(exc)) from None
    results = Path(args.results or f"results/{job.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    _check_results_folder(results, job, resume=args.resume)
    run = LocalRun(job, results, rollout_workers=args.workers)
    try:
        code = run.run()
    except LocalRunFailed as exc:
        print(f"rljob run failed: {exc}", file=sys.stderr)
        workers = f" --workers {args.workers}" if args.workers != 1 else ""
        print(
            f"rljob run: continue it with: rljob run {args.file} --local --results {results}{workers} --resume",
            file=sys.stderr,
        )
        return 1
    if code == 0:
        from rljob.plots import plot_run

        plot_run(results)
        summary = summarise(results)
        for line in closing_lines(summary, job):
            print(f"[rljob] {line}")
    return code


def closing_lines(summary: dict, job: RLJob) -> list[str]:
    """What a finished local run shows a newcomer: what the warm-up did, the score before and after
    RL on the same questions (the difference is RL's alone), and the training reward's trend."""
    lines = []
    scored = "validation slice" if job.spec.eval.split == "validation" else "evaluation set"
    warmup = summary.get("warmup")
    if warmup:
        lines.append(
            f"warm-up (supervised, before RL): {warmup['examples']} demonstrations, {warmup['steps']} steps, "
            f"loss {warmup['first_loss']:.2f} -> {warmup['last_loss']:.2f}; 'before RL' below includes it"
        )
    names = {"eval_before": "before RL", "eval_after": f"after {summary.get('steps_trained', 0)} RL steps"}
    for label, name in names.items():
        if label in summary:
            ev = summary[label]
            lines.append(
                f"{name}: EM {ev['exact_match']:.3f}  F1 {ev['f1']:.3f}  format {ev['format_rate']:.2f}  "
                f"searches/q {ev['searches_per_question']:.2f}  (n={ev['questions']}, {scored})"
            )
    if all("per_question" in summary.get(label, {}) for label in names):
        from rljob.stats import compare_paired

        paired = compare_paired(summary["eval_before"]["per_question"], summary["eval_after"]["per_question"])
        lines.append(f"RL's change, paired on the same questions: {paired.line()}")
    rewards = summary.get("rewards") or []
    if len(rewards) >= 4:
        quarter = len(rewards) // 4
        first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
        line = f"training reward, mean of the first {quarter} RL steps {first:.3f} -> last {quarter} {last:.3f}"
        pool, per_step = job.spec.grpo.max_questions, job.spec.grpo.questions_per_step
        if pool and (quarter * per_step) % pool == 0:
            line += f" (each quarter asks the same {pool} questions, grpo.maxQuestions)"
        lines.append(line)
    lines.append(f"done: metrics, evals and plots in {summary['results_dir']}")
    return lines


def cmd_rollout(args: argparse.Namespace) -> int:
    env, job = _pod_job()
    from rljob.rollout.worker import run_rollout_worker

    # Without a `stop` event, the worker ends its loop on SIGTERM or SIGINT (it installs the handlers).
    run_rollout_worker(job, env.authenticated_redis_url, env.worker_id, metrics_port=args.metrics_port)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    env, job = _pod_job()
    from rljob.trainer.loop import run_trainer

    # A progress bar for a terminal; a pod's log (or any file) gets one log line per step instead.
    progress = sys.stderr.isatty()
    run_trainer(job, env.authenticated_redis_url, env.checkpoint_dir, results_dir=env.results_dir, progress=progress)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    # Everything the evaluation will read or write is checked here, before the model loads (minutes
    # for a large one), so a typo fails at once rather than after loading or, for --output, at the end.
    job = load_job(args.file)
    if args.questions:
        _check_questions_file(args.questions)
    if args.checkpoint and not (Path(args.checkpoint).is_dir() and _has_checkpoint(Path(args.checkpoint))):
        raise BadInput(f"--checkpoint {args.checkpoint}: not a trainer checkpoint (step-N) or a folder of them")
    if args.limit is not None and args.limit < 1:
        raise BadInput(f"--limit must be at least 1, not {args.limit}")
    if args.split == "validation":
        if args.questions:
            raise BadInput("--split validation scores the manifest's validation slice: drop --questions")
        if job.spec.data.validation_questions < 1:
            raise BadInput("--split validation: the manifest sets no spec.data.validationQuestions")
    if args.output and Path(args.output).is_dir():
        raise BadInput(f"--output {args.output}: a folder; give the path of the JSON file to write")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise BadInput(f"--output {args.output}: its folder does not exist")
    from rljob.evaluate import evaluate_cli

    return evaluate_cli(args, job)


def _check_questions_file(path: str) -> None:
    """An existing HotpotQA file whose first record parses (an empty one is refused, not replaced by the eval set)."""
    if not Path(path).is_file():
        raise BadInput(f"--questions {path}: no such file")
    from rljob.data.hotpotqa import load_questions

    try:
        first = load_questions(path, limit=1)
    except (ValueError, KeyError, TypeError) as error:
        raise BadInput(f"--questions {path}: not HotpotQA JSON or JSON Lines ({error})") from error
    if not first:
        raise BadInput(f"--questions {path}: holds no questions")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an RLJob manifest on this machine")
    run.add_argument("file", help="RLJob manifest (YAML)")
    run.add_argument("--local", action="store_true", help="embedded Redis, workers and trainers as processes")
    run.add_argument("--results", help="results folder (default results/NAME-TIMESTAMP)")
    run.add_argument("--workers", type=int, default=1, help="rollout worker processes")
    run.add_argument("--resume", action="store_true", help="go on with the run already in --results")
    run.set_defaults(func=cmd_run)

    rollout = sub.add_parser("rollout", help="rollout worker (pod entry point; configured by RLJOB_* env)")
    rollout.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    rollout.set_defaults(func=cmd_rollout)

    train = sub.add_parser("train", help="trainer rank (pod entry point; configured by RLJOB_* and torch env)")
    train.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="score a checkpoint or the base model on a question file")
    ev.add_argument("file", help="RLJob manifest whose model, agent and data settings to use")
    ev.add_argument("--questions", help="HotpotQA JSON/JSONL (default: the manifest's eval set)")
    ev.add_argument("--checkpoint", help="trainer checkpoint directory (default: the untrained model)")
    ev.add_argument("--limit", type=int, default=None, help="first N questions")
    ev.add_argument(
        "--split",
        choices=["eval", "validation"],
        default="eval",
        help="eval: the manifest's eval set (or --questions); validation: its slice of the training "
        "questions that neither warm-up nor RL uses (spec.data.validationQuestions)",
    )
    ev.add_argument("--output", help="write the result JSON here")
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return int(args.func(args) or 0)
    except BadInput as exc:
        print(f"rljob {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
