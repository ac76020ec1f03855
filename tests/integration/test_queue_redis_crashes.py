"""The queue protocol while its redis-server is killed outright (SIGKILL) and restarted on its
append-only file, again and again: rounds of prompts out and groups in still finish, every group
arrives once, and nothing is left pending. The workers and the trainer use the real retrying
client (`rljob.redis_client.connect`) and the real queue ends; only the model is left out."""

from __future__ import annotations

import random
import threading

import pytest

from rljob.keys import ROLLOUT_GROUP, TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest, Trajectory, TrajectoryGroup
from rljob.queue import worker_end as rollout
from rljob.queue.trainer_end import TrajectoryCollector, enqueue_prompts, eval_round
from rljob.redis_client import connect

pytestmark = pytest.mark.integration

KEYS = JobKeys("ns", "crashes")


def _group(req: PromptRequest, worker: str) -> TrajectoryGroup:
    traj = Trajectory(
        token_ids=list(range(96)),
        prompt_length=32,
        loss_mask=[0] * 32 + [1] * 64,
        behaviour_logprobs=[0.0] * 32 + [-0.5] * 64,
        policy_version=0,
    )
    return TrajectoryGroup(
        request_id=req.request_id,
        step=req.step,
        question_id=req.question_id,
        worker_id=worker,
        trajectories=[traj] * req.group_size,
    )


def _serve(url: str, worker: str, stop: threading.Event, errors: list[BaseException]) -> None:
    """A rollout worker's loop without a model: reclaim, read, publish once."""
    client = connect(url)
    try:
        while not stop.is_set():
            held = rollout.reclaim_stale(client, KEYS, worker, min_idle_ms=1000, count=2)
            held = held or rollout.read_new(client, KEYS, worker, count=2, block_ms=50)
            answered = rollout.DoneSet(client, KEYS).answered([h.request.request_id for h in held])
            rollout.acknowledge(client, [h for h in held if h.request.request_id in answered])
            for h in held:
                if h.request.request_id not in answered:
                    stop.wait(0.005)  # "generation": leaves the reads and writes interleaved
                    rollout.publish_group(client, KEYS, h, _group(h.request, worker))
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)
    finally:
        client.close()


def _kill_now_and_then(server, stop: threading.Event, kills: list[int]) -> None:
    rng = random.Random(0)
    while not stop.wait(rng.uniform(0.05, 0.4)):
        server.restart()  # SIGKILL, then the same port on the same AOF
        kills.append(1)


@pytest.mark.timeout(600)
def test_rounds_finish_and_nothing_is_lost_while_redis_is_killed_again_and_again(redis_server) -> None:
    client = connect(redis_server.url)
    rollout.ensure_groups(client, KEYS)
    collector = TrajectoryCollector(client, KEYS, block_ms=50, lost_check_s=1.0)
    stop, errors, kills = threading.Event(), [], []
    threads = [threading.Thread(target=_serve, args=(redis_server.url, f"w{i}", stop, errors)) for i in range(2)]
    killer = threading.Thread(target=_kill_now_and_then, args=(redis_server, stop, kills))
    for t in threads:
        t.start()
    killer.start()
    step = 0
    try:
        while len(kills) < 25:  # rounds until Redis has died often enough, mid-round most times
            step += 1
            assert step < 5000, "the killer thread stopped killing"
            reqs = [
                PromptRequest(
                    request_id=f"s{step}-q{i}",
                    step=step,
                    question_id=f"q{i}",
                    question="who?",
                    answers=["a"],
                    group_size=2,
                )
                for i in range(4)
            ]
            collector.expect(reqs)
            enqueue_prompts(client, KEYS.prompts, reqs)
            groups, entry_ids = collector.collect(step, [r.request_id for r in reqs], timeout_s=90)
            assert [g.request_id for g in groups] == [r.request_id for r in reqs]
            collector.ack(entry_ids, done=[r.request_id for r in reqs])
            if step % 5 == 0:  # an evaluation round: results read by XREAD, not by a group
                evals = [
                    PromptRequest(
                        request_id=f"eval-{step}-{i}",
                        step=-1,
                        question_id=f"d{i}",
                        question="who?",
                        answers=["a"],
                        group_size=1,
                        greedy=True,
                    )
                    for i in range(2)
                ]
                assert [g.request_id for g in eval_round(client, KEYS, evals, timeout_s=90, block_ms=50)] == [
                    r.request_id for r in evals
                ]
    finally:
        stop.set()
        killer.join(timeout=30)
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    # Every prompt was answered and every group read; a late duplicate may wait unread in the
    # stream (the next collect drops it), but nothing is held by a consumer.
    assert client.xpending(KEYS.prompts, ROLLOUT_GROUP)["pending"] == 0
    assert client.xpending(KEYS.trajectories, TRAINER_GROUP)["pending"] == 0
    client.close()
