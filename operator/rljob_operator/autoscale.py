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
from rljob.keys import ROLLOUT_GROUP, JobKeys


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


def backlog_from_groups(groups: list[dict[str, Any]], stream_length: int) -> int:
    """Lag + pending of the rollout group from XINFO GROUPS.

    Redis reports no lag before 7.0, and none after a deletion it cannot see past (workers delete
    each prompt as they acknowledge it, so an answered prompt newer than a pending one is enough).
    Then the stream's length is the backlog: it holds exactly the undelivered and the pending
    entries.
    """
    for group in groups:
        name = group.get("name")
        name = name.decode() if isinstance(name, bytes) else name
        if name == ROLLOUT_GROUP:
            lag = group.get("lag")
            if lag is None:
                return stream_length
            return int(lag) + int(group.get("pending", 0))
    return stream_length  # no group yet: nothing has been read


def read_backlog(client: Any, keys: JobKeys) -> int:
    """What the rollout workers owe over both prompt streams they serve: training prompts and
    evaluation prompts (an evaluation the trainer waits on needs workers too). A stream that does
    not exist yet counts 0."""
    backlog = 0
    for stream in (keys.prompts, keys.eval_prompts):
        if client.exists(stream):
            backlog += backlog_from_groups(client.xinfo_groups(stream), int(client.xlen(stream)))
    return backlog
