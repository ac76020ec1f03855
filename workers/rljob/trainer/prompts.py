"""Which prompts the trainer asks for: question pools, the per-epoch order, step, refill and eval requests.

Pure functions of the job, the step and the seeds, so every rank, epoch and restart agrees.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Sequence
from typing import Any

from rljob import evaluate
from rljob.config import RLJob
from rljob.protocol import EVAL_ID_PREFIX, PromptRequest

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def epoch_order(epoch: int, total: int, seed: int) -> tuple[int, ...]:
    """Epoch `epoch`'s shuffle of the `total` training questions.

    Cached: shuffling costs O(total), and every step reads a slice of the same one or two epochs,
    twice; a few entries cover a step straddling epochs plus look-ahead.
    """
    order = list(range(total))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def question_slots(first: int, count: int, total: int, seed: int) -> list[int]:
    """Questions at positions first..first+count-1 of the endless sequence of per-epoch shuffles."""
    return [epoch_order(slot // total, total, seed)[slot % total] for slot in range(first, first + count)]


def question_indices(step: int, per_step: int, total: int, seed: int) -> list[int]:
    """Which training questions step `step` uses: consecutive slices of a per-epoch shuffle.

    A pure function of the step, so a resumed run asks exactly what an uninterrupted one would;
    O(per_step) once the epoch's order is cached.
    """
    return question_slots(step * per_step, per_step, total, seed)


REFILL_SEED = 500_009  # refill prompts come from their own shuffle, not the next steps' questions


def refill_requests(
    step: int, round_: int, count: int, questions: Sequence[Any], job: RLJob, min_policy_version: int, run_tag: str
) -> list[PromptRequest]:
    """Extra prompts for step `step` (dynamic sampling), round `round_`: at most questionsPerStep."""
    grpo = job.spec.grpo
    first = (step * max(grpo.max_refill_rounds, 1) + round_) * grpo.questions_per_step
    idx = question_slots(first, min(count, grpo.questions_per_step), len(questions), job.spec.data.seed + REFILL_SEED)
    return _training_prompts(f"s{step}-x{round_}", step, [questions[i] for i in idx], job, min_policy_version, run_tag)


def _training_prompts(
    prefix: str, step: int, chosen: Sequence[Any], job: RLJob, min_policy_version: int, run_tag: str
) -> list[PromptRequest]:
    return [
        PromptRequest.for_question(
            question,
            f"{prefix}-q{slot}-r{run_tag}-{question.id}",
            step=step,
            group_size=job.spec.grpo.group_size,
            min_policy_version=min_policy_version,
        )
        for slot, question in enumerate(chosen)
    ]


def step_requests(
    step: int, questions: Sequence[Any], job: RLJob, min_policy_version: int, run_tag: str = ""
) -> list[PromptRequest]:
    """Step `step`'s prompts. `run_tag` (the first version this gang process published) keeps ids
    unique across restarts: rollout workers answer a request id only once, so a restarted trainer
    that re-asks for a step must use new ids."""
    grpo = job.spec.grpo
    idx = question_indices(step, grpo.questions_per_step, len(questions), job.spec.data.seed)
    return _training_prompts(f"s{step}", step, [questions[i] for i in idx], job, min_policy_version, run_tag)


def eval_requests(step: int, questions: Sequence[Any], version: int) -> list[PromptRequest]:
    """Greedy requests scoring the weights of `step` (policy `version`), with ids no other step shares."""
    return evaluate.eval_requests(
        questions, f"{EVAL_ID_PREFIX}s{step}-v{version}", step=step, min_policy_version=version
    )


def load_questions(job: RLJob) -> tuple[list[Any], list[Any]]:
    """(RL prompt pool, the questions evaluations score): the warm-up's pool and the validation slice
    are out of the RL pool, and so is any training question the evaluation set also holds. Evaluations
    score the evaluation set, or the validation slice under `eval.split: validation`."""
    from rljob.data import load_questions_for_spec
    from rljob.data.pools import job_pools

    train, evaluation = load_questions_for_spec(job.spec.data)
    pools = job_pools(job.spec, [q.id for q in train], [q.id for q in evaluation])
    rl = [train[i] for i in pools.rl]
    sizes = pools.sizes()
    if job.spec.grpo.answerable_only:
        rl = answerable_questions(job, rl, train, evaluation)
        sizes["rl_answerable"] = len(rl)
        if not rl:
            raise ValueError(
                "grpo.answerableOnly: no RL question's answer appears in its retrieved passages; raise agent.topK "
                "or agent.passageMaxWords, or turn answerableOnly off"
            )
    if job.spec.grpo.max_questions is not None and len(rl) > job.spec.grpo.max_questions:
        rl = rl[: job.spec.grpo.max_questions]
        sizes["rl_used"] = len(rl)
    scored = [train[i] for i in pools.validation] if job.spec.eval.split == "validation" else evaluation
    log.info(
        "question pools: %s of %d training questions; %d evaluation questions; evaluations score the %s",
        sizes,
        len(train),
        len(evaluation),
        job.spec.eval.split,
    )
    return rl, scored


def answerable_questions(job: RLJob, questions: Sequence[Any], train: Sequence[Any], evaluation: Sequence[Any]) -> list:
    """The questions whose gold answer is in what the job's retriever returns for the question itself."""
    from rljob.retrieval.retriever import retriever_for
    from rljob.warmup.demonstrations import answer_found

    agent = job.spec.agent
    hits = retriever_for(job.spec.data, train, evaluation).search_batch([q.question for q in questions], agent.top_k)
    return [
        q
        for q, passages in zip(questions, hits, strict=True)
        if any(answer_found(a, passages, agent.passage_max_words) for a in q.answers)
    ]
