"""Operator-native rollout autoscaling: replicas follow the prompt backlog, within bounds.

The backlog is what rollout workers still owe, over the training and the evaluation prompt
streams: each consumer group's lag (prompts not yet delivered) plus its pending entries
(delivered, not acknowledged). Scale-up is immediate;
scale-down waits out a cooldown so a burst between steps does not flap workers (and a worker
in the middle of a batch is not removed for a momentary dip).
"""

from __future__ import annotations

import math
from typing import Any

from rljob.config import RolloutSpec
from rljob.keys import JobKeys
from rljob.queue.backlog import backlog_from_groups


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


def read_backlog(client: Any, keys: JobKeys) -> int:
    """What the rollout workers owe over both prompt streams they serve: training prompts and
    evaluation prompts (an evaluation the trainer waits on needs workers too). A stream that does
    not exist yet counts 0."""
    backlog = 0
    for stream in (keys.prompts, keys.eval_prompts):
        if client.exists(stream):
            backlog += backlog_from_groups(client.xinfo_groups(stream), int(client.xlen(stream)))
    return backlog
