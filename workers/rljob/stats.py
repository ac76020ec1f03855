"""Paired comparisons of two evaluations on the same questions: is a change more than noise?

Before and after scores of one question are correlated, so a paired test sees much smaller changes
than comparing two means: McNemar's exact test on exact match (only questions whose correctness
flipped carry information) and a bootstrap interval on the mean F1 difference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact p-value of McNemar's test: under no change, each flip is a fair coin."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = math.fsum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def bootstrap_interval(
    diffs: Sequence[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the mean of `diffs` over resamples of the questions."""
    if not diffs:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(math.fsum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    low = means[int((1 - level) / 2 * resamples)]
    high = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return (low, high)


@dataclass(frozen=True)
class PairedComparison:
    questions: int
    em_before: float
    em_after: float
    em_gain: float
    em_gained: int  # questions wrong before and right after
    em_lost: int  # right before, wrong after
    em_p_value: float  # McNemar's exact test
    f1_before: float
    f1_after: float
    f1_gain: float
    f1_gain_interval: tuple[float, float]  # 95% bootstrap

    def line(self) -> str:
        low, high = self.f1_gain_interval
        em = (
            f"EM {self.em_before:.3f} -> {self.em_after:.3f} ({self.em_gain:+.3f}; {self.em_gained} gained, "
            f"{self.em_lost} lost, McNemar p={self.em_p_value:.3g})"
        )
        f1 = f"F1 {self.f1_before:.3f} -> {self.f1_after:.3f} ({self.f1_gain:+.3f}, 95% CI {low:+.3f}..{high:+.3f})"
        return f"{em}  {f1}  n={self.questions}"


def compare_paired(before: Sequence[Mapping], after: Sequence[Mapping]) -> PairedComparison:
    """Compare per-question scores ({"id", "em", "f1"}) on the questions both evaluations hold."""
    first = {row["id"]: row for row in before}
    pairs = [(first[row["id"]], row) for row in after if row["id"] in first]
    if not pairs:
        raise ValueError("the two evaluations share no question id")
    n = len(pairs)
    gained = sum(1 for b, a in pairs if a["em"] > b["em"])
    lost = sum(1 for b, a in pairs if a["em"] < b["em"])
    em_b, em_a = (math.fsum(b["em"] for b, _ in pairs) / n, math.fsum(a["em"] for _, a in pairs) / n)
    f1_b, f1_a = (math.fsum(b["f1"] for b, _ in pairs) / n, math.fsum(a["f1"] for _, a in pairs) / n)
    return PairedComparison(
        questions=n,
        em_before=em_b,
        em_after=em_a,
        em_gain=em_a - em_b,
        em_gained=gained,
        em_lost=lost,
        em_p_value=mcnemar_exact(gained, lost),
        f1_before=f1_b,
        f1_after=f1_a,
        f1_gain=f1_a - f1_b,
        f1_gain_interval=bootstrap_interval([a["f1"] - b["f1"] for b, a in pairs]),
    )


def sign_flip_p_value(diffs: Sequence[float], *, resamples: int = 20_000, seed: int = 0) -> float:
    """Two-sided randomization p-value of a mean paired difference of zero.

    Under no change, before and after of a question are exchangeable, so each question's difference
    is as likely negated; on one run's 0/1 EM differences this is McNemar's exact test by sampling.
    """
    observed = abs(math.fsum(diffs))
    moving = [d for d in diffs if d]
    if not moving:
        return 1.0
    rng = random.Random(seed)
    hits = sum(
        abs(math.fsum(d if rng.random() < 0.5 else -d for d in moving)) >= observed - 1e-12 for _ in range(resamples)
    )
    return (hits + 1) / (resamples + 1)


@dataclass(frozen=True)
class ReplicatedComparison:
    """Before/after over several replicates (seeds) of one recipe, scored on the same questions.

    The question-level test and interval take each question's gain averaged over the replicates, so
    they say whether the recipe moves these questions on average, given these seeds; the spread of
    the per-replicate gains is the seed-to-seed variation they do not include.
    """

    replicates: int
    questions: int
    em_gains: tuple[float, ...]  # per replicate
    em_gain: float  # mean over replicates
    em_gain_spread: float  # standard deviation of the per-replicate gains
    em_gain_interval: tuple[float, float]  # 95% bootstrap over questions
    em_p_value: float  # sign-flip test over questions
    f1_gains: tuple[float, ...]
    f1_gain: float
    f1_gain_interval: tuple[float, float]
    f1_p_value: float

    def line(self) -> str:
        em_lo, em_hi = self.em_gain_interval
        f1_lo, f1_hi = self.f1_gain_interval
        return (
            f"{self.replicates} replicates x {self.questions} questions: EM gain {self.em_gain:+.3f} "
            f"(per replicate {', '.join(f'{g:+.3f}' for g in self.em_gains)}; 95% CI {em_lo:+.3f}..{em_hi:+.3f}, "
            f"p={self.em_p_value:.3g})  F1 gain {self.f1_gain:+.3f} (95% CI {f1_lo:+.3f}..{f1_hi:+.3f}, "
            f"p={self.f1_p_value:.3g})"
        )


def compare_replicated(runs: Sequence[tuple[Sequence[Mapping], Sequence[Mapping]]]) -> ReplicatedComparison:
    """Pool (before, after) per-question scores of replicates, on the questions all of them hold."""
    if not runs:
        raise ValueError("no replicate to compare")
    tables = [({r["id"]: r for r in before}, {r["id"]: r for r in after}) for before, after in runs]
    shared = set.intersection(*(set(b) & set(a) for b, a in tables))
    if not shared:
        raise ValueError("the replicates share no question id")
    ids = sorted(shared)

    def gains(metric: str) -> tuple[list[float], list[float]]:
        per_run = [[a[q][metric] - b[q][metric] for q in ids] for b, a in tables]
        per_question = [math.fsum(run[i] for run in per_run) / len(runs) for i in range(len(ids))]
        return [math.fsum(run) / len(ids) for run in per_run], per_question

    em_runs, em_questions = gains("em")
    f1_runs, f1_questions = gains("f1")
    mean_em = math.fsum(em_runs) / len(runs)
    spread = math.sqrt(math.fsum((g - mean_em) ** 2 for g in em_runs) / (len(runs) - 1)) if len(runs) > 1 else 0.0
    return ReplicatedComparison(
        replicates=len(runs),
        questions=len(ids),
        em_gains=tuple(em_runs),
        em_gain=mean_em,
        em_gain_spread=spread,
        em_gain_interval=bootstrap_interval(em_questions),
        em_p_value=sign_flip_p_value(em_questions),
        f1_gains=tuple(f1_runs),
        f1_gain=math.fsum(f1_runs) / len(runs),
        f1_gain_interval=bootstrap_interval(f1_questions),
        f1_p_value=sign_flip_p_value(f1_questions),
    )
