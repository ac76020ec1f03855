"""Stream retention, batch limits and unparsable groups against a real redis-server.

The job's Redis runs with noeviction: an acknowledged entry left in a stream is memory that never
comes back. Every stream must return to what is still in flight, round after round.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
import redis

from rljob.keys import ROLLOUT_GROUP, TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest
from rljob.queue import worker_end as rollout
from rljob.queue.backlog import pending_prompts
from rljob.queue.trainer_end import IncompatibleGroupError, TrajectoryCollector, enqueue_prompts, eval_round
from support.queue_worker import fake_group, serve_without_model

pytestmark = pytest.mark.integration

KEYS = JobKeys("ns", "retention")


def _request(request_id: str, step: int = 0, greedy: bool = False) -> PromptRequest:
    return PromptRequest(
        request_id=request_id,
        step=step,
        question_id="q",
        question="who?",
        answers=["a"],
        group_size=1 if greedy else 4,
        greedy=greedy,
    )


def _serve(url: str, worker: str, stop: threading.Event, errors: list[BaseException]) -> None:
    serve_without_model(redis.Redis.from_url(url), KEYS, worker, stop, errors)


def _one_eval_worker(url: str, answer: Callable[[redis.Redis, list[rollout.HeldPrompt]], object]) -> threading.Thread:
    """A worker thread that takes the next prompt and answers it with `answer(client, held)`."""

    def run() -> None:
        client = redis.Redis.from_url(url)
        held: list[rollout.HeldPrompt] = []
        while not held:
            held = rollout.read_new(client, KEYS, "w", count=1, block_ms=50)
        answer(client, held)
        client.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _lengths(client: redis.Redis) -> dict[str, int]:
    streams = (KEYS.prompts, KEYS.eval_prompts, KEYS.trajectories, KEYS.eval_results)
    return {s.split("}:")[-1]: int(client.xlen(s)) for s in streams}


def _bad_publish(client: redis.Redis, held: rollout.HeldPrompt) -> None:
    """What a worker of another rljob version does: a group this trainer's model rejects."""
    body = {**json.loads(fake_group(held.request).model_dump_json()), "added_in_a_newer_version": 1}
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(KEYS.trajectories, {"data": json.dumps(body)})
        pipe.sadd(KEYS.rollout_done, held.request.request_id)
        pipe.xack(held.stream, ROLLOUT_GROUP, held.entry_id)
        pipe.xdel(held.stream, held.entry_id)
        pipe.execute()


@pytest.mark.timeout(300)
def test_many_rounds_leave_the_streams_empty_and_memory_flat(redis_server, redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50)
    stop, errors = threading.Event(), []
    workers = [threading.Thread(target=_serve, args=(redis_server.url, f"w{i}", stop, errors)) for i in range(2)]
    for w in workers:
        w.start()
    published, baseline, rounds, questions = 0, None, 60, 6
    try:
        for step in range(rounds):
            reqs = [_request(f"s{step}-q{i}", step) for i in range(questions)]
            collector.expect(reqs)
            enqueue_prompts(redis_client, KEYS.prompts, reqs)
            groups, entry_ids = collector.collect(step, [r.request_id for r in reqs], timeout_s=60)
            collector.ack(entry_ids, done=[r.request_id for r in reqs])  # after the step is "trained and published"
            published += sum(len(g.model_dump_json()) for g in groups)
            if step % 10 == 9:
                evals = [_request(f"e{step}-q{i}", -1, greedy=True) for i in range(3)]
                assert len(eval_round(redis_client, KEYS, evals, timeout_s=60, block_ms=50)) == 3
            assert _lengths(redis_client) == {"prompts": 0, "eval:prompts": 0, "trajectories": 0, "eval:results": 0}
            if step == 9:
                baseline = redis_client.info("memory")["used_memory"]
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    assert not errors, errors
    grown = redis_client.info("memory")["used_memory"] - baseline
    # 50 rounds moved ~7 MB of groups; nothing of them stays but noise.
    assert published > 5_000_000
    assert grown < 400_000, f"used_memory grew {grown} bytes over 50 rounds"
    for stream, group in ((KEYS.prompts, ROLLOUT_GROUP), (KEYS.trajectories, TRAINER_GROUP)):
        assert redis_client.xpending(stream, group)["pending"] == 0
    assert redis_client.scard(KEYS.rollout_done) == 0  # trained steps and read evals leave the done set


def test_lag_after_out_of_order_deletes(redis_client) -> None:
    """Deleting only delivered entries can still leave Redis unable to compute the group lag: when
    the group's last delivered entry is deleted while an older one is still pending. The backlog the
    workers report stays right (the stream's length), and the lag comes back once the older one goes."""
    rollout.ensure_groups(redis_client, KEYS)
    enqueue_prompts(redis_client, KEYS.prompts, [_request(f"r{i}") for i in range(4)])
    (older,) = rollout.read_new(redis_client, KEYS, "slow", count=1, block_ms=0)
    (newer,) = rollout.read_new(redis_client, KEYS, "fast", count=1, block_ms=0)

    def group_info() -> dict:
        return next(g for g in redis_client.xinfo_groups(KEYS.prompts) if g["name"] == ROLLOUT_GROUP.encode())

    assert group_info()["lag"] == 2 and pending_prompts(redis_client, KEYS) == 4
    rollout.publish_group(redis_client, KEYS, newer, fake_group(newer.request))
    # redis-server 7.0 reports null here (the tombstone sits at the last delivered id); a newer one may know it is 2
    assert group_info()["lag"] in (None, 2)
    assert group_info()["pending"] == 1 and redis_client.xlen(KEYS.prompts) == 3
    assert pending_prompts(redis_client, KEYS) == 3  # falls back to the length: still exact
    rollout.publish_group(redis_client, KEYS, older, fake_group(older.request))
    assert group_info()["lag"] == 2 and pending_prompts(redis_client, KEYS) == 2


def test_read_new_never_takes_more_than_count(redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    enqueue_prompts(redis_client, KEYS.eval_prompts, [_request(f"e{i}", -1, greedy=True) for i in range(3)])
    enqueue_prompts(redis_client, KEYS.prompts, [_request(f"s{i}") for i in range(10)])
    first = rollout.read_new(redis_client, KEYS, "w", count=4, block_ms=100)
    assert [h.request.request_id for h in first] == ["e0", "e1", "e2", "s0"]  # evaluation first
    second = rollout.read_new(redis_client, KEYS, "w", count=4, block_ms=100)
    assert [h.request.request_id for h in second] == ["s1", "s2", "s3", "s4"]


def test_read_new_waits_for_work_without_taking_more(redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    started = time.monotonic()
    assert rollout.read_new(redis_client, KEYS, "w", count=2, block_ms=200) == []
    assert time.monotonic() - started >= 0.15

    def later() -> None:
        time.sleep(0.3)
        enqueue_prompts(redis_client, KEYS.prompts, [_request(f"s{i}") for i in range(5)])
        enqueue_prompts(redis_client, KEYS.eval_prompts, [_request(f"e{i}", -1, greedy=True) for i in range(5)])

    thread = threading.Thread(target=later)
    thread.start()
    started = time.monotonic()
    taken = rollout.read_new(redis_client, KEYS, "w", count=2, block_ms=10_000)
    thread.join()
    assert 1 <= len(taken) <= 2 and time.monotonic() - started < 5
    assert len(rollout.read_new(redis_client, KEYS, "w", count=3, block_ms=10_000)) == 3


def test_a_dead_worker_and_a_dead_trainer_lose_nothing(redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    reqs = [_request(f"s{i}") for i in range(3)]
    enqueue_prompts(redis_client, KEYS.prompts, reqs)
    assert len(rollout.read_new(redis_client, KEYS, "dead", count=3, block_ms=0)) == 3  # and never answers
    taken = rollout.reclaim_stale(redis_client, KEYS, "alive", min_idle_ms=0, count=3)
    assert [h.request.request_id for h in taken] == ["s0", "s1", "s2"]
    for h in taken:
        rollout.publish_group(redis_client, KEYS, h, fake_group(h.request))
    assert redis_client.xlen(KEYS.prompts) == 0

    first = TrajectoryCollector(redis_client, KEYS, block_ms=50)
    first.expect(reqs)
    first.collect(0, [r.request_id for r in reqs], timeout_s=5)  # then dies before acknowledging
    assert redis_client.xlen(KEYS.trajectories) == 3
    again = TrajectoryCollector(redis_client, KEYS, block_ms=50)  # the restarted gang, same consumer
    again.expect(reqs)
    groups, entry_ids = again.collect(0, [r.request_id for r in reqs], timeout_s=5)
    assert [g.request_id for g in groups] == ["s0", "s1", "s2"]
    again.ack(entry_ids)
    assert redis_client.xlen(KEYS.trajectories) == 0


def test_a_group_whose_delivery_reply_was_lost_is_read_back(redis_client) -> None:
    """Redis killed between logging an XREADGROUP and answering it restarts with the entry pending
    for the trainer, which never saw it: the step must still get its group, not wait forever."""
    rollout.ensure_groups(redis_client, KEYS)
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50, lost_check_s=0.2)
    reqs = [_request("s0"), _request("s1")]
    collector.expect(reqs)
    enqueue_prompts(redis_client, KEYS.prompts, reqs)
    first, second = rollout.read_new(redis_client, KEYS, "w", count=2, block_ms=0)
    rollout.publish_group(redis_client, KEYS, first, fake_group(first.request))
    with pytest.raises(TimeoutError):  # s0 is buffered; s1 is not published yet
        collector.collect(0, ["s0", "s1"], timeout_s=0.5)
    rollout.publish_group(redis_client, KEYS, second, fake_group(second.request))
    # The lost reply: delivered to the trainer's consumer, read by nobody.
    assert redis_client.xreadgroup(TRAINER_GROUP, collector.consumer, {KEYS.trajectories: ">"})
    groups, entry_ids = collector.collect(0, ["s0", "s1"], timeout_s=10)
    assert [g.request_id for g in groups] == ["s0", "s1"]
    # Reading back our pending list did not acknowledge the group we already held.
    assert redis_client.xpending(KEYS.trajectories, TRAINER_GROUP)["pending"] == 2
    collector.ack(entry_ids, done=["s0", "s1"])
    assert redis_client.xpending(KEYS.trajectories, TRAINER_GROUP)["pending"] == 0
    assert redis_client.xlen(KEYS.trajectories) == 0


def test_a_prompt_redis_lost_in_a_restart_is_enqueued_again(redis_server, redis_client) -> None:
    """With appendfsync everysec a crash loses the last second of writes: the prompts just enqueued
    may be gone. The step's wait notices (neither queued nor answered) and enqueues them again."""
    rollout.ensure_groups(redis_client, KEYS)
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50, lost_check_s=0.2)
    reqs = [_request("s0"), _request("s1")]
    collector.expect(reqs)
    enqueue_prompts(redis_client, KEYS.prompts, reqs)
    lost = redis_client.xrange(KEYS.prompts)[1][0]
    redis_client.xdel(KEYS.prompts, lost)  # what Redis holds after losing that XADD
    stop, errors = threading.Event(), []
    worker = threading.Thread(target=_serve, args=(redis_server.url, "w", stop, errors))
    worker.start()
    try:
        groups, entry_ids = collector.collect(0, ["s0", "s1"], timeout_s=10)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not errors, errors
    assert [g.request_id for g in groups] == ["s0", "s1"]
    collector.ack(entry_ids, done=["s0", "s1"])
    assert _lengths(redis_client) == {"prompts": 0, "eval:prompts": 0, "trajectories": 0, "eval:results": 0}


def test_an_eval_prompt_redis_lost_in_a_restart_is_enqueued_again(redis_server, redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    stop, errors, workers = threading.Event(), [], []

    def lose_then_serve() -> None:  # the round's prompt is gone before any worker saw it
        if not workers:
            redis_client.xdel(KEYS.eval_prompts, *[entry_id for entry_id, _ in redis_client.xrange(KEYS.eval_prompts)])
            workers.append(threading.Thread(target=_serve, args=(redis_server.url, "w", stop, errors)))
            workers[0].start()

    try:
        request = _request("eval-0", -1, greedy=True)
        got = eval_round(
            redis_client, KEYS, [request], timeout_s=10, block_ms=50, on_wait=lose_then_serve, lost_check_s=0.2
        )
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
    assert not errors, errors
    assert [g.request_id for g in got] == ["eval-0"]


def _answered_unparsably(redis_client) -> tuple[TrajectoryCollector, PromptRequest]:
    """A trainer expecting one request that a worker answered with a group it cannot parse, after
    its first collect (which re-enqueues the prompt and times out)."""
    rollout.ensure_groups(redis_client, KEYS)
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50)
    req = _request("s0-q0")
    collector.expect([req])
    enqueue_prompts(redis_client, KEYS.prompts, [req])
    (held,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)
    _bad_publish(redis_client, held)
    with pytest.raises(TimeoutError):
        collector.collect(0, [req.request_id], timeout_s=0.5)
    return collector, req


def test_an_unparsable_group_is_requeued_and_then_answered(redis_client) -> None:
    collector, req = _answered_unparsably(redis_client)
    # The trainer put the prompt back and forgot that it was answered: a worker serves it as new.
    assert not redis_client.sismember(KEYS.rollout_done, req.request_id)
    (again,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)
    assert again.request == req
    assert rollout.publish_group(redis_client, KEYS, again, fake_group(req))
    groups, entry_ids = collector.collect(0, [req.request_id], timeout_s=5)
    assert [g.request_id for g in groups] == [req.request_id]
    collector.ack(entry_ids)
    assert _lengths(redis_client) == {"prompts": 0, "eval:prompts": 0, "trajectories": 0, "eval:results": 0}


def test_a_worker_of_another_version_fails_the_trainer_promptly(redis_client) -> None:
    collector, req = _answered_unparsably(redis_client)  # the one retry
    (held,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)
    _bad_publish(redis_client, held)
    with pytest.raises(IncompatibleGroupError, match="different version") as caught:
        collector.collect(0, [req.request_id], timeout_s=30)
    assert "added_in_a_newer_version" in str(caught.value) and req.request_id in str(caught.value)


def test_an_unparsable_eval_result_fails_at_once_and_old_leftovers_are_trimmed(redis_server, redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)
    redis_client.xadd(KEYS.eval_results, {"data": "left by a round that timed out long ago"})

    renamed = {"data": '{"request_id": "e0", "renamed": true}'}
    thread = _one_eval_worker(redis_server.url, lambda client, _: client.xadd(KEYS.eval_results, renamed))
    started = time.monotonic()
    with pytest.raises(IncompatibleGroupError, match="different version"):
        eval_round(redis_client, KEYS, [_request("e0", -1, greedy=True)], timeout_s=60, block_ms=50)
    thread.join()
    assert time.monotonic() - started < 10 and redis_client.xlen(KEYS.eval_results) == 0


def test_eval_round_runs_its_wait_hook_while_it_waits(redis_client) -> None:
    # The trainer answers weight-rebase requests from this hook: workers that cannot load the
    # latest version answer no eval prompt until it is re-exported.
    calls = []
    with pytest.raises(TimeoutError):
        eval_round(redis_client, KEYS, [_request("e0")], timeout_s=0.3, block_ms=50, on_wait=lambda: calls.append(1))
    assert len(calls) >= 2


def test_a_dead_workers_prompts_behind_many_live_ones_are_reclaimed(redis_client) -> None:
    # XAUTOCLAIM looks at ten times COUNT pending entries per call: started from 0-0 every time, a
    # dead worker's prompts behind 45 that live workers hold (their idle time kept fresh by the
    # heartbeat) were never reached with a batch of 3.
    rollout.ensure_groups(redis_client, KEYS)
    enqueue_prompts(redis_client, KEYS.prompts, [_request(f"live{i}") for i in range(45)])
    live = rollout.read_new(redis_client, KEYS, "live", count=45, block_ms=0)
    enqueue_prompts(redis_client, KEYS.prompts, [_request(f"dead{i}") for i in range(3)])
    assert len(rollout.read_new(redis_client, KEYS, "dead", count=3, block_ms=0)) == 3
    time.sleep(0.2)
    rollout.refresh_idle(redis_client, "live", live)  # the live worker's heartbeat
    taken = rollout.reclaim_stale(redis_client, KEYS, "alive", min_idle_ms=150, count=3)
    assert sorted(h.request.request_id for h in taken) == ["dead0", "dead1", "dead2"]


class _NewerTrainersPrompt(PromptRequest):
    """A prompt as a trainer one rljob version ahead writes it: a field this worker does not know."""

    added_in_a_newer_version: int = 1


def _newer_trainers_prompt(request_id: str, step: int = 0, greedy: bool = False) -> _NewerTrainersPrompt:
    return _NewerTrainersPrompt(**_request(request_id, step, greedy).model_dump())


def test_a_prompt_the_worker_cannot_parse_fails_the_trainer_instead_of_hanging_it(redis_server, redis_client) -> None:
    # The worker acknowledged and deleted a prompt it could not parse; its id never reached the done
    # set, so the trainer, waiting without a timeout, waited for its group forever.
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50)
    req = _newer_trainers_prompt("s0-q0")
    collector.expect([req])
    rollout.ensure_groups(redis_client, KEYS)
    enqueue_prompts(redis_client, KEYS.prompts, [req])
    stop, errors = threading.Event(), []

    def worker() -> None:  # the worker's own handling of what it cannot parse
        client = redis.Redis.from_url(redis_server.url)
        while not stop.is_set():
            held = rollout.read_new(client, KEYS, "w", count=3, block_ms=50)
            rollout.reject(client, KEYS, [h for h in held if h.request is None])
        client.close()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        with pytest.raises(IncompatibleGroupError, match="different version") as caught:
            collector.collect(0, [req.request_id], timeout_s=30)
    finally:
        stop.set()
        thread.join()
    assert "could not parse its prompt" in str(caught.value) and "added_in_a_newer_version" in str(caught.value)
    assert collector.requeued[req.request_id] == 2  # retried once, as an unparsable group is
    assert not errors


def test_an_eval_prompt_the_worker_cannot_parse_fails_the_round_at_once(redis_server, redis_client) -> None:
    rollout.ensure_groups(redis_client, KEYS)

    thread = _one_eval_worker(redis_server.url, lambda client, held: rollout.reject(client, KEYS, held))
    started = time.monotonic()
    with pytest.raises(IncompatibleGroupError, match="could not parse eval prompt eval-x"):
        eval_round(redis_client, KEYS, [_newer_trainers_prompt("eval-x", -1, greedy=True)], timeout_s=60, block_ms=50)
    thread.join()
    assert time.monotonic() - started < 10


def test_late_and_unknown_groups_and_timed_out_eval_rounds_leave_nothing_in_the_done_set(
    redis_server, redis_client
) -> None:
    # A reclaimed prompt's slow first worker publishes after the step trained; an earlier run's
    # group arrives after a restart; an eval round times out and its prompts are answered later.
    # Each put an id into the done set that nothing ever took out (Redis runs with noeviction).
    collector = TrajectoryCollector(redis_client, KEYS, block_ms=50)
    rollout.ensure_groups(redis_client, KEYS)

    def train(req: PromptRequest) -> None:
        """One step of one request: enqueued, served, collected, trained and acknowledged."""
        collector.expect([req])
        enqueue_prompts(redis_client, KEYS.prompts, [req])
        (held,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)
        assert rollout.publish_group(redis_client, KEYS, held, fake_group(req))
        _, entry_ids = collector.collect(req.step, [req.request_id], timeout_s=5)
        collector.ack(entry_ids, done=[req.request_id])

    req = _request("s0-q0")
    train(req)
    late = rollout.HeldPrompt(KEYS.prompts, "0-1", b"", req)  # its prompt is long gone
    assert rollout.publish_group(redis_client, KEYS, late, fake_group(req))  # the slow worker's copy
    earlier_run = _request("s1-q0-r7-x", step=1)
    assert rollout.publish_group(
        redis_client, KEYS, rollout.HeldPrompt(KEYS.prompts, "0-2", b"", earlier_run), fake_group(earlier_run)
    )
    train(_request("s1-q0", step=1))  # reads both on the way
    assert redis_client.smembers(KEYS.rollout_done) == set()

    with pytest.raises(TimeoutError):
        eval_round(redis_client, KEYS, [_request("eval-a", -1, greedy=True)], timeout_s=0.2, block_ms=50)
    assert redis_client.smembers(KEYS.rollout_done) == set()
    (held,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)  # answered after the timeout
    assert rollout.publish_group(redis_client, KEYS, held, fake_group(held.request))
    served = _one_eval_worker(
        redis_server.url,
        lambda client, held: rollout.publish_group(client, KEYS, held[0], fake_group(held[0].request)),
    )
    eval_round(redis_client, KEYS, [_request("eval-b", -1, greedy=True)], timeout_s=30, block_ms=50)
    served.join()
    assert redis_client.smembers(KEYS.rollout_done) == set()


def test_a_restarted_trainer_clears_what_its_earlier_run_left_queued(redis_client) -> None:
    # The restarted gang asks for its steps under new request ids and drops groups answering the
    # old ones: the old prompts, still queued (eval ones served first), were generated for nothing.
    from rljob.queue.trainer_end import clear_earlier_runs

    rollout.ensure_groups(redis_client, KEYS)
    old = [_request(f"s{k}-q0-r3-x", step=k) for k in range(3)]
    enqueue_prompts(redis_client, KEYS.prompts, old)
    enqueue_prompts(redis_client, KEYS.eval_prompts, [_request("eval-s2-v3-0-x", 2, greedy=True)])
    (held,) = rollout.read_new(redis_client, KEYS, "w", count=1, block_ms=0)  # eval first: a worker holds it
    assert clear_earlier_runs(redis_client, KEYS) == 4
    assert _lengths(redis_client)["prompts"] == _lengths(redis_client)["eval:prompts"] == 0
    assert rollout.read_new(redis_client, KEYS, "w", count=5, block_ms=0) == []
    assert rollout.publish_group(redis_client, KEYS, held, fake_group(held.request))  # finishes harmlessly
    assert pending_prompts(redis_client, KEYS) == 0
    assert clear_earlier_runs(redis_client, KEYS) == 0
