"""The supervised warm-up loop: masked next-token loss on demonstrations, AdamW, progress lines.

Batches go through the trainer's own `collate`, so the loss covers exactly the tokens the GRPO loss
would (the loss mask, shifted by one); injected <information> text and the prompt never carry loss.
Runs on the trainer's rank 0 before version 0 is published, so rollout workers start from it.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rljob.config import RLJob, WarmupSpec
from rljob.data.hotpotqa import job_records, parse_question
from rljob.data.pools import job_pools
from rljob.trainer.batch import MicroBatch, Sample, collate, micro_batches
from rljob.trainer.logits import masked_token_logprobs
from rljob.warmup.demonstrations import Demonstration, build_demonstrations

log = logging.getLogger(__name__)


class WarmupError(ValueError):
    """An enabled warm-up that cannot run as configured (rather than RL silently starting cold)."""


@dataclass
class WarmupResult:
    examples: int = 0
    records_read: int = 0
    two_search_examples: int = 0
    steps: int = 0
    first_loss: float = 0.0
    last_loss: float = 0.0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def as_sample(demo: Demonstration) -> Sample:
    """A demonstration in the trainer's batch shape (advantage and behaviour log-probs unused)."""
    return Sample(demo.token_ids, demo.loss_mask, [0.0] * len(demo.token_ids), 1.0)


def masked_nll(
    model: torch.nn.Module, mb: MicroBatch, autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, int]:
    """(sum of -log p over the micro-batch's loss tokens, their count); the output layer is applied
    only where the loss is taken (`rljob.trainer.logits`)."""
    logp = masked_token_logprobs(model, mb, autocast_dtype=autocast_dtype).logp
    return -logp.sum(), int(mb.mask.sum())


def run_sft(
    model: torch.nn.Module,
    demos: Sequence[Demonstration],
    spec: WarmupSpec,
    *,
    pad_token_id: int,
    device: torch.device | str = "cpu",
    micro_batch_size: int = 2,
    progress: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> WarmupResult:
    """Train `model` in place on `demos` for `spec.epochs` passes; loss is the token mean per step."""
    started = time.perf_counter()
    result = WarmupResult(examples=len(demos), two_search_examples=sum(len(d.searches) > 1 for d in demos))
    if not demos:
        return result
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0)
    order = random.Random(spec.seed)
    was_training = model.training
    model.train()
    total_steps = spec.epochs * -(-len(demos) // spec.batch_size)
    for _ in range(spec.epochs):
        shuffled = list(demos)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), spec.batch_size):
            batch = [as_sample(d) for d in shuffled[start : start + spec.batch_size]]
            tokens = sum(s.num_loss_tokens for s in batch)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for part in micro_batches(batch, micro_batch_size):
                nll, _ = masked_nll(model, collate(part, pad_token_id, device), autocast_dtype)
                (nll / tokens).backward()  # token mean over the whole step, however it is split
                total += float(nll.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            result.steps += 1
            result.losses.append(total / max(tokens, 1))
            if progress:
                print(
                    f"[warmup] step {result.steps}/{total_steps} loss {result.losses[-1]:.4f} "
                    f"tokens {tokens} {time.perf_counter() - started:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    result.first_loss, result.last_loss = result.losses[0], result.losses[-1]
    result.seconds = time.perf_counter() - started
    return result


def job_demonstrations(
    job: RLJob, tokenizer: Any, retriever: Any, eval_ids: Iterable[str] = ()
) -> tuple[list[Demonstration], int]:
    """The job's demonstrations: questions of its warm-up pool only (`rljob.data.pools`), which RL
    never samples and the evaluation never holds, in a seeded order."""
    data, warm = job.spec.data, job.spec.warmup
    records = list(job_records(data.source, data.train_path, data.max_train_questions, "train"))
    if records:  # none: nothing to split, and the warm-up reports that it found no demonstration
        pools = job_pools(job.spec, [parse_question(r).id for r in records], eval_ids)
        records = [records[i] for i in pools.warmup]
    random.Random(warm.seed).shuffle(records)
    return build_demonstrations(
        records, tokenizer, retriever, job.spec.agent, limit=warm.examples, max_searches=warm.max_searches
    )


def warmup_for_job(
    job: RLJob,
    model: torch.nn.Module,
    device: torch.device | str = "cpu",
    progress: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> WarmupResult:
    """Build the job's demonstrations with its tokenizer and retriever, then fine-tune `model`."""
    from rljob.engines.models import load_tokenizer
    from rljob.retrieval.retriever import build_retriever_for_spec
    from rljob.trainer.model import pad_token_id_of

    tokenizer = load_tokenizer(job.spec.model)
    retriever, _, evaluation = build_retriever_for_spec(job.spec.data)
    demos, read = job_demonstrations(job, tokenizer, retriever, [q.id for q in evaluation])
    wanted = job.spec.warmup.examples
    if not demos:
        raise WarmupError(
            f"spec.warmup is enabled but none of the {read} train questions read gave a demonstration (the gold "
            "answer must appear in the retrieved passages, and each turn must fit agent.maxNewTokensPerTurn and "
            "the whole within agent.maxTotalTokens): raise those budgets or data.maxTrainQuestions, or disable "
            "the warm-up"
        )
    if len(demos) < wanted:
        log.warning(
            "warm-up: %d of the %d demonstrations wanted, from all %d train questions read", len(demos), wanted, read
        )
    if progress:
        print(f"[warmup] {len(demos)} demonstrations from {read} train questions", file=sys.stderr, flush=True)
    result = run_sft(
        model,
        demos,
        job.spec.warmup,
        pad_token_id=pad_token_id_of(model),
        device=device,
        progress=progress,
        autocast_dtype=autocast_dtype,
    )
    result.records_read = read
    return result
