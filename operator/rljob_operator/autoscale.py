"""Operator-native rollout autoscaling: replicas follow the prompt backlog, within bounds.

The backlog is what rollout workers still owe, over the training and the evaluation prompt
streams: each consumer group's lag (prompts not yet delivered) plus its pending entries
(delivered, not acknowledged), counted by `rljob.queue.backlog`. Scale-up is immediate; scale-down
waits out a cooldown so a burst between steps does not flap workers (and a worker in the middle
of a batch is not removed for a momentary dip).
"""

from __future__ import annotations

import math
from typing import Any

from rljob.config import RLJob, RolloutSpec


def desired_replicas(*, current: int, backlog: int | None, spec: RolloutSpec, seconds_since_scale: float | None) -> int:
    """Replicas to run now; `backlog=None` (Redis unreachable) keeps the current count in bounds."""
    lo, hi = spec.min_replicas, spec.max_replicas
    if backlog is None:
        return min(max(current, lo), hi)
    target = min(max(math.ceil(backlog / spec.pending_per_replica), lo), hi)
    cooling = seconds_since_scale is not None and seconds_since_scale < spec.scale_down_cooldown_seconds
    if target < current and cooling:
        return min(current, hi)
    return target


def rollout_replicas(
    job: RLJob,
    deployment: dict[str, Any] | None,
    backlog: int | None,
    *,
    forced_off: bool,
    seconds_since_scale: float | None,
) -> tuple[int, int]:
    """(current, desired) replicas of the rollout Deployment. KEDA owns the count when it scales
    (the operator only keeps the floor); a job whose gang cannot run (suspended, finished) runs none."""
    spec = job.spec.rollout
    current = int((deployment or {}).get("spec", {}).get("replicas", spec.min_replicas) or 0)
    if forced_off:
        return current, 0
    if spec.autoscaler == "keda":
        return current, max(current, spec.min_replicas)
    start = current if deployment else spec.min_replicas
    return current, desired_replicas(current=start, backlog=backlog, spec=spec, seconds_since_scale=seconds_since_scale)
