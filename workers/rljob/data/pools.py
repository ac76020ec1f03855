"""Disjoint question pools of one job: warm-up demonstrations, a validation slice, RL prompts.

Each pool is a fixed part of the training questions, chosen by question id from a seeded
shuffle, so the split is a pure function of the data and the spec: every epoch, every restart and
every gang rank sees the same pools. A question whose id is also in the evaluation set is in no
pool (a user who points trainPath and evalPath at overlapping files still never trains on what
is scored). Choosing settings on the validation slice, never on the evaluation set, keeps the
evaluation an honest estimate.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rljob.config import RLJobSpec

_POOL_SEED = 7_919  # mixed into data.seed: the pool shuffle is not the RL epoch shuffle


@dataclass(frozen=True)
class QuestionPools:
    """Indices into the job's training questions, in pool order; no index is in two pools."""

    warmup: tuple[int, ...]
    validation: tuple[int, ...]
    rl: tuple[int, ...]
    held_out_as_eval: int  # training questions left out because the evaluation set has them

    def sizes(self) -> dict[str, int]:
        return {
            "warmup": len(self.warmup),
            "validation": len(self.validation),
            "rl": len(self.rl),
            "dropped_eval_overlap": self.held_out_as_eval,
        }


def split_pools(
    train_ids: Sequence[str], eval_ids: Iterable[str], *, warmup: int, validation: int, seed: int
) -> QuestionPools:
    """The first `warmup` questions of a seeded shuffle (duplicates and eval ids dropped) go to the
    warm-up, the next `validation` to the validation slice, the rest to RL."""
    held = set(eval_ids)
    order = list(range(len(train_ids)))
    random.Random(seed * 1_000_003 + _POOL_SEED).shuffle(order)
    seen: set[str] = set()
    usable, dropped = [], 0
    for i in order:
        qid = train_ids[i]
        if qid in held:
            dropped += 1
            continue
        if qid in seen:
            continue
        seen.add(qid)
        usable.append(i)
    if warmup + validation >= len(usable):
        raise ValueError(
            f"the warm-up ({warmup}) and validation ({validation}) pools take all {len(usable)} usable training "
            "questions, leaving none for RL: lower warmup.questionPool or data.validationQuestions, or raise "
            "data.maxTrainQuestions"
        )
    return QuestionPools(
        warmup=tuple(usable[:warmup]),
        validation=tuple(usable[warmup : warmup + validation]),
        rl=tuple(usable[warmup + validation :]),
        held_out_as_eval=dropped,
    )


def warmup_pool_size(spec: RLJobSpec, usable: int) -> int:
    """Training questions the warm-up reserves: none when it is off, `warmup.questionPool` when set,
    else 2 x examples but at most half of what the validation slice leaves (RL keeps the rest)."""
    warm = spec.warmup
    if not warm.enabled:
        return 0
    if warm.question_pool is not None:
        return warm.question_pool
    return min(2 * warm.examples, max(usable - spec.data.validation_questions, 0) // 2)


def job_pools(spec: RLJobSpec, train_ids: Sequence[str], eval_ids: Iterable[str]) -> QuestionPools:
    """The pools `spec` asks for over the job's training questions (as loaded, in file order)."""
    held = set(eval_ids)
    usable = len(set(train_ids) - held)
    return split_pools(
        train_ids,
        held,
        warmup=warmup_pool_size(spec, usable),
        validation=spec.data.validation_questions,
        seed=spec.data.seed,
    )
