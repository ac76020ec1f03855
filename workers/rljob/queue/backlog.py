"""How many prompts are waiting: what the operator's autoscaler and the workers' metrics read."""

from __future__ import annotations

from typing import Any

import redis

from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.queue.wire import text


def backlog_from_groups(groups: list[dict[str, Any]], stream_length: int) -> int:
    """Lag + pending of the rollout group from XINFO GROUPS: prompts not yet delivered plus
    delivered and unacknowledged (the operator's autoscaler counts the same).

    Redis reports no lag before 7.0, and none after a deletion it cannot see past (an answered
    prompt newer than a pending one is enough, since each is deleted as it is acknowledged). Then
    the stream's length is the backlog: it holds exactly the undelivered and the pending entries.
    """
    for group in groups:
        if text(group.get("name", b"")) == ROLLOUT_GROUP:
            lag = group.get("lag")
            if lag is None:
                return stream_length
            return int(lag) + int(group.get("pending") or 0)
    return stream_length  # no group yet: nothing has been read


def pending_prompts(client: redis.Redis, keys: JobKeys) -> int:
    """What the rollout workers owe over both prompt streams they serve: training prompts and
    evaluation prompts (an evaluation the trainer waits on needs workers too). A stream that does
    not exist yet counts 0."""
    return sum(
        backlog_from_groups(client.xinfo_groups(stream), int(client.xlen(stream)))
        for stream in (keys.prompts, keys.eval_prompts)
        if client.exists(stream)
    )
