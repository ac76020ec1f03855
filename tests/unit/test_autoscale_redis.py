"""The autoscaler's backlog read against a real redis-server (consumer-group lag + pending)."""

from __future__ import annotations

import pytest

from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.queue.backlog import pending_prompts


@pytest.mark.integration
def test_backlog_counts_undelivered_and_unacked(redis_client) -> None:
    keys = JobKeys("ns", "job")
    assert pending_prompts(redis_client, keys) == 0
    for i in range(10):
        redis_client.xadd(keys.prompts, {"data": str(i)})
    assert pending_prompts(redis_client, keys) == 10  # no group yet: everything is pending work
    redis_client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    taken = redis_client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"}, count=4)
    assert pending_prompts(redis_client, keys) == 10  # 6 undelivered + 4 delivered, unacknowledged
    ids = [entry_id for _, entries in taken for entry_id, _ in entries]
    redis_client.xack(keys.prompts, ROLLOUT_GROUP, *ids[:3])
    assert pending_prompts(redis_client, keys) == 7


def _with_groups(client, keys: JobKeys) -> JobKeys:
    """Both prompt streams with the rollout group, as the trainer creates them."""
    for stream in (keys.prompts, keys.eval_prompts):
        client.xgroup_create(stream, ROLLOUT_GROUP, id="0", mkstream=True)
    return keys


@pytest.mark.integration
def test_backlog_counts_evaluation_prompts_as_the_workers_do(redis_client) -> None:
    # An evaluation the trainer waits on is work for the rollout workers too: with only
    # evaluation prompts queued, the autoscaler must not see an empty backlog (and scale to
    # minReplicas, possibly zero, while the trainer waits).
    keys = _with_groups(redis_client, JobKeys("ns", "evaljob"))
    for i in range(6):
        redis_client.xadd(keys.eval_prompts, {"data": str(i)})
    assert pending_prompts(redis_client, keys) == 6 == pending_prompts(redis_client, keys)
    for i in range(3):
        redis_client.xadd(keys.prompts, {"data": str(i)})
    redis_client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.eval_prompts: ">"}, count=2)
    assert pending_prompts(redis_client, keys) == 9 == pending_prompts(redis_client, keys)


@pytest.mark.integration
def test_backlog_when_redis_cannot_compute_the_lag(redis_client) -> None:
    # Workers delete each prompt as they acknowledge it. A prompt answered (and deleted) after an
    # older one that is still pending leaves Redis unable to compute the group's lag: the backlog
    # is then the stream's length (undelivered + pending), not length + pending.
    keys = _with_groups(redis_client, JobKeys("ns", "lagless"))
    for i in range(5):
        redis_client.xadd(keys.prompts, {"data": str(i)})
    taken = redis_client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"}, count=2)
    newer = taken[0][1][1][0]
    redis_client.xack(keys.prompts, ROLLOUT_GROUP, newer)
    redis_client.xdel(keys.prompts, newer)
    group = next(
        g for g in redis_client.xinfo_groups(keys.prompts) if g["name"] in (ROLLOUT_GROUP, ROLLOUT_GROUP.encode())
    )
    assert group["lag"] is None  # what this test is about (Redis 7.0+)
    assert pending_prompts(redis_client, keys) == 4 == pending_prompts(redis_client, keys)  # 3 undelivered + 1 pending
