"""Group-relative advantages: each sample is judged only against its own group's other samples.

A group whose rewards are all equal says nothing about which behaviour is better, so every one of
its advantages is exactly zero (and the step drops the group: see `batch.trainable_samples`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, scale: bool = True, eps: float = 1e-6) -> list[float]:
    """Advantages of one group: reward minus the group mean, divided by the group std if `scale`.

    The std is the unbiased sample std (as TRL's GRPO); `eps` keeps near-equal groups finite.
    Computed in Python floats (double precision) so every rank gets the same bits.
    """
    n = len(rewards)
    if is_degenerate(rewards):  # also an empty group: []
        return [0.0] * n
    mean = math.fsum(rewards) / n
    centered = [r - mean for r in rewards]
    if not scale:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / (n - 1))
    return [c / (std + eps) for c in centered]


def is_degenerate(rewards: Sequence[float]) -> bool:
    """True when a group cannot rank its samples: fewer than two, or all rewards equal."""
    return len(rewards) < 2 or all(r == rewards[0] for r in rewards)
