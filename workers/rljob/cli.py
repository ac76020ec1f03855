"""The `rljob` command: local runs, and the entry points of the rollout and trainer pods."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path


def cmd_run(args: argparse.Namespace) -> int:
    from rljob.config import load_rljob
    from rljob.local_run import LocalRun, LocalRunFailed, summarise
    from rljob.runtime_env import resolve_bundled

    if not args.local:
        print("rljob run needs --local (on a cluster: helm install the operator and kubectl apply -f FILE)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        job = resolve_bundled(load_rljob(args.file))
    except (FileNotFoundError, ValueError) as exc:
        print(f"rljob run: {exc}", file=sys.stderr)
        return 2
    results = Path(args.results or f"results/{job.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run = LocalRun(job, results, rollout_workers=args.workers)
    try:
        code = run.run()
    except LocalRunFailed as exc:
        print(f"rljob run failed: {exc}", file=sys.stderr)
        return 1
    if code == 0:
        from rljob.plots import plot_run

        plot_run(results)
        summary = summarise(results)
        for label in ("eval_before", "eval_after"):
            if label in summary:
                ev = summary[label]
                print(f"[rljob] {label.replace('_', ' ')}: EM {ev['exact_match']:.3f}  F1 {ev['f1']:.3f}  "
                      f"format {ev['format_rate']:.2f}  searches/q {ev['searches_per_question']:.2f}  "
                      f"(n={ev['questions']})")  # fmt: skip
        print(f"[rljob] done: metrics, evals and plots in {results}")
    return code


def _install_stop_handler() -> threading.Event:
    stop = threading.Event()

    def handle(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop


def cmd_rollout(args: argparse.Namespace) -> int:
    from rljob.rollout.worker import run_rollout_worker
    from rljob.runtime_env import WorkerEnv

    env = WorkerEnv.from_environ()
    stop = _install_stop_handler()
    run_rollout_worker(env.load_job(), env.authenticated_redis_url, env.worker_id, stop=stop,
                       metrics_port=args.metrics_port)  # fmt: skip
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rljob.runtime_env import WorkerEnv
    from rljob.trainer.loop import run_trainer

    env = WorkerEnv.from_environ()
    run_trainer(env.load_job(), env.authenticated_redis_url, env.checkpoint_dir, results_dir=env.results_dir)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rljob.evaluate import evaluate_cli

    return evaluate_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an RLJob manifest on this machine")
    run.add_argument("file", help="RLJob manifest (YAML)")
    run.add_argument("--local", action="store_true", help="embedded Redis, workers and trainers as processes")
    run.add_argument("--results", help="results folder (default results/NAME-TIMESTAMP)")
    run.add_argument("--workers", type=int, default=1, help="rollout worker processes")
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
    ev.add_argument("--output", help="write the result JSON here")
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
