"""`rljob eval`: greedy Search-R1 evaluation of a model or a trainer checkpoint on a question file.

Runs in one process with the same agent loop, retriever and rewards as the rollout workers, so
its numbers are comparable with the evaluations the trainer runs through the workers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rljob.config import RLJob
from rljob.protocol import PromptRequest, TrajectoryGroup
from rljob.trainer.metrics import eval_summary

EVAL_BATCH = 8  # questions per generate_groups call (one progress line each)


def eval_requests(
    questions: Sequence[Any], tag: str = "eval", *, step: int = -1, min_policy_version: int = 0
) -> list[PromptRequest]:
    """One greedy sample per question; `step` and `min_policy_version` for the trainer's evaluations
    of its own weights (through the rollout workers)."""
    return [
        PromptRequest.for_question(
            q, f"{tag}-{i}-{q.id}", step=step, group_size=1, min_policy_version=min_policy_version, greedy=True
        )
        for i, q in enumerate(questions)
    ]


def evaluate_engine(engine: Any, retriever: Any, questions: Sequence[Any], agent_spec: Any) -> dict[str, float | int]:
    """Greedy-evaluate `engine` on `questions`, printing a progress line per batch."""
    from rljob.agent.rollout import generate_groups

    requests = eval_requests(questions)
    groups: list[TrajectoryGroup] = []
    started = time.perf_counter()
    for start in range(0, len(requests), EVAL_BATCH):
        groups += generate_groups(engine, retriever, requests[start : start + EVAL_BATCH], agent_spec)
        running = eval_summary(groups)
        print(
            f"[eval] {len(groups)}/{len(requests)} questions  EM {running['exact_match']:.3f}  "
            f"F1 {running['f1']:.3f}  {time.perf_counter() - started:.0f}s",
            file=sys.stderr,
            flush=True,
        )
    return eval_summary(groups)


def load_checkpoint_weights(path: str | Path) -> dict[str, Any]:
    """The policy's parameters from a trainer checkpoint directory (a step dir or its parent)."""
    from rljob.trainer.checkpoint import latest_checkpoint, load_checkpoint

    chosen = Path(path)
    if not (chosen / "state.pt").exists():
        found = latest_checkpoint(chosen)
        if found is None:
            raise FileNotFoundError(f"no trainer checkpoint in {path}")
        chosen = found
    return load_checkpoint(chosen).trainer["model"]


def round_to_served(model: Any) -> None:
    """Round the weights to the bf16 values the weight store serves, in place.

    Rollout workers run what the trainer publishes (bf16 values, also in an fp32 model), and the
    trainer's evaluations run on them; scoring the fp32 base model or fp32 checkpoint masters
    instead can change greedy trajectories, so `rljob eval` numbers would not be the trainer's.
    Round to nearest even, as the publisher.
    """
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != torch.bfloat16:
                param.copy_(param.to(torch.bfloat16))


def questions_to_score(questions: list[Any], job: Any, *, from_file: bool, limit: int | None) -> list[Any]:
    """Which questions `rljob eval` scores: a `--questions` file whole, else the ones the trainer's
    evaluations score (the first `eval.questions` of the job's eval set), so the two compare; then
    at most `limit`."""
    chosen = questions if from_file else questions[: job.spec.eval.questions]
    return chosen[:limit] if limit else chosen


def evaluate_cli(args: argparse.Namespace, job: RLJob) -> int:
    """`rljob eval` on a job `rljob.cli` has loaded and checked."""
    import torch

    from rljob.data.hotpotqa import load_questions
    from rljob.data.pools import job_pools
    from rljob.engines import load_engine
    from rljob.retrieval import build_retriever_for_spec

    from_file = load_questions(args.questions, limit=args.limit) if args.questions else []
    retriever, train, eval_questions = build_retriever_for_spec(job.spec.data, extra_eval=from_file)
    if args.split == "validation":  # the slice of the training questions neither warm-up nor RL uses
        pools = job_pools(job.spec, [q.id for q in train], [q.id for q in eval_questions])
        questions = [train[i] for i in pools.validation][: args.limit or None]
    else:
        questions = from_file if args.questions else eval_questions
        questions = questions_to_score(questions, job, from_file=bool(args.questions), limit=args.limit)
    engine = load_engine(job.spec.model, "hf", "cuda" if torch.cuda.is_available() else "cpu")
    if args.checkpoint:
        weights = load_checkpoint_weights(args.checkpoint)
        missing, unexpected = engine.model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise SystemExit(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    round_to_served(engine.model)
    result = evaluate_engine(engine, retriever, questions, job.spec.agent)
    result["checkpoint"] = str(args.checkpoint) if args.checkpoint else "untrained"
    print(json.dumps({k: v for k, v in result.items() if k != "per_question"}))  # per question: in --output
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0
