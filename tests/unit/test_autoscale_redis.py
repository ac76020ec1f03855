"""The autoscaler's backlog read against a real redis-server (consumer-group lag + pending)."""

from __future__ import annotations

import pytest

from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob_operator.autoscale import read_backlog


@pytest.mark.integration
def test_backlog_counts_undelivered_and_unacked(redis_client) -> None:
    keys = JobKeys("ns", "job")
    assert read_backlog(redis_client, keys) == 0
    for i in range(10):
        redis_client.xadd(keys.prompts, {"data": str(i)})
    assert read_backlog(redis_client, keys) == 10  # no group yet: everything is pending work
    redis_client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    taken = redis_client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"}, count=4)
    assert read_backlog(redis_client, keys) == 10  # 6 undelivered + 4 delivered, unacknowledged
    ids = [entry_id for _, entries in taken for entry_id, _ in entries]
    redis_client.xack(keys.prompts, ROLLOUT_GROUP, *ids[:3])
    assert read_backlog(redis_client, keys) == 7
