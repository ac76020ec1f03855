"""Untrained SmolLM2-135M-Instruct on dev.jsonl with the search protocol (greedy, CPU).

Reports EM, F1, the fraction of answers in the right format, searches per question, turns and
finish reasons, beside a no-search reference: the same model asked to answer directly (max_turns 1
with the same prompt, so every search it tries goes unanswered).
  python benchmarks/baseline_eval.py --quick            # 20 questions
  python benchmarks/baseline_eval.py --time-budget 600  # as many as fit in ~10 minutes
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import RESULTS, finish, progress

from rljob.agent.rollout import generate_groups
from rljob.assets import hotpotqa_file, smollm2_model_dir
from rljob.config import AgentSpec, ModelSpec
from rljob.data.hotpotqa import build_corpus, load_questions
from rljob.engines.hf import HFEngine
from rljob.protocol import PromptRequest
from rljob.retrieval import Retriever


def _metrics(groups) -> dict:
    trajs = [t for g in groups for t in g.trajectories]
    n = max(len(trajs), 1)
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    return {
        "questions": len(trajs),
        "exact_match": sum(t.exact_match for t in trajs) / n,
        "f1": sum(t.f1 for t in trajs) / n,
        "format_rate": sum(t.format_ok for t in trajs) / n,
        "searches_per_question": sum(len(t.searches) for t in trajs) / n,
        "searched_fraction": sum(bool(t.searches) for t in trajs) / n,
        "turns_per_question": sum(t.num_turns for t in trajs) / n,
        "generated_tokens_per_question": sum(sum(t.loss_mask) for t in trajs) / n,
        "finish_reasons": reasons,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="20 questions")
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--time-budget", type=float, default=600.0, help="stop starting batches after this (s)")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    limit = 20 if args.quick else args.questions
    dev = load_questions(hotpotqa_file("dev.jsonl"))[:limit]
    train = load_questions(hotpotqa_file("train.jsonl"))
    retriever = Retriever(build_corpus(train + load_questions(hotpotqa_file("dev.jsonl"))))
    progress(f"corpus {len(retriever.passages)} passages (train+dev), index {retriever.build_seconds:.1f}s")
    model_dir = smollm2_model_dir()
    engine = HFEngine.from_spec(ModelSpec(name=str(model_dir), dtype="float32"), device="cpu")
    spec = AgentSpec()  # the job defaults: 4 turns, 64 tokens a turn, 1024 in all, top-3, 60-word passages
    direct = spec.model_copy(update={"max_turns": 1})
    started = time.perf_counter()
    groups, direct_groups = [], []
    for start in range(0, len(dev), args.batch):
        if time.perf_counter() - started > args.time_budget:
            progress(f"time budget reached after {start} questions")
            break
        requests = [
            PromptRequest(
                request_id=q.id,
                step=0,
                question_id=q.id,
                question=q.question,
                answers=q.answers,
                group_size=1,
                greedy=True,
            )
            for q in dev[start : start + args.batch]
        ]
        groups += generate_groups(engine, retriever, requests, spec)
        direct_groups += generate_groups(engine, retriever, requests, direct)
        m = _metrics(groups)
        elapsed = time.perf_counter() - started
        progress(
            f"{len(groups)}/{len(dev)} questions, {elapsed:.0f}s: EM {m['exact_match']:.3f} F1 {m['f1']:.3f} "
            f"format {m['format_rate']:.2f} searches/q {m['searches_per_question']:.2f}"
        )
    seconds = time.perf_counter() - started
    protocol, no_search = _metrics(groups), _metrics(direct_groups)
    summary = {
        "benchmark": "baseline",
        "quick": args.quick,
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "threads": args.threads,
        "seconds": seconds,
        "agent": spec.model_dump(),
        "search_protocol": protocol,
        "direct_answer": no_search,
    }
    progress(f"{'':26}{'protocol':>10}{'direct':>10}")
    for key in ("exact_match", "f1", "format_rate", "searches_per_question", "turns_per_question"):
        progress(f"{key:26}{protocol[key]:10.3f}{no_search[key]:10.3f}")
    examples = [
        (q.question, q.answers, engine.tokenizer.decode(t.token_ids[t.prompt_length :]))
        for q, g in zip(dev, groups[:3], strict=False)
        for t in g.trajectories
    ]
    _write_examples(examples, args.quick)
    finish("baseline_quick" if args.quick else "baseline", summary)


def _write_examples(examples: list, quick: bool) -> None:
    path = RESULTS / ("baseline_quick_examples.md" if quick else "baseline_examples.md")
    lines = ["# Untrained SmolLM2-135M-Instruct: first trajectories (greedy)", ""]
    for question, answers, text in examples:
        lines += [f"**Q:** {question}  ", f"**gold:** {answers}", "", "```", text.strip(), "```", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
