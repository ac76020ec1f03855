"""The queue protocol while its redis-server is killed outright (SIGKILL) and restarted on its
append-only file, again and again: rounds of prompts out and groups in still finish, every group
arrives once, and nothing is left pending. The workers and the trainer use the real retrying
client (`rljob.redis_client.connect`) and the real queue ends; only the model is left out."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from rljob.keys import TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup
from rljob.queue import worker_end as rollout
from rljob.queue.trainer_end import TrajectoryCollector, enqueue_prompts, eval_round
from rljob.queue.wire import text
from rljob.redis_client import connect
from support.queue_worker import serve_without_model

pytestmark = pytest.mark.integration

KEYS = JobKeys("ns", "crashes")


def _serve(url: str, worker: str, stop: threading.Event, errors: list[BaseException]) -> None:
    """Reclaims what a worker held before a restart after 1 s, pausing 5 ms per group."""
    serve_without_model(connect(url), KEYS, worker, stop, errors, count=2, reclaim_idle_ms=1000, pause_s=0.005)


def _newest_aof(server) -> Path:
    return max((server.workdir / "appendonlydir").glob("*.incr.aof"), key=lambda f: int(f.name.split(".")[-3]))


def _whole_write_ends(data: bytes, offset: int) -> list[int]:
    """Offsets in an AOF from `offset` (a command's start) where a command ends outside MULTI/EXEC.

    Cut there, Redis loads the rest as it was written. Cut inside a transaction, Redis 7.0 keeps the
    MULTI open and runs its first half with the next transaction (valkey-io/valkey#4342 fixes
    that), a state no client could have produced."""
    ends, depth = [offset], 0
    while offset < len(data):
        line_end = data.index(b"\r\n", offset)
        argc, offset, args = int(data[offset + 1 : line_end]), line_end + 2, []
        for _ in range(argc):
            line_end = data.index(b"\r\n", offset)
            length = int(data[offset + 1 : line_end])
            args.append(data[line_end + 2 : line_end + 2 + length])
            offset = line_end + 4 + length
        command = args[0].upper()
        depth = 1 if command == b"MULTI" else 0 if command == b"EXEC" else depth
        if depth == 0:
            ends.append(offset)
    return ends


def _kill_now_and_then(server, lose_last_writes: bool, stop: threading.Event, kills: list[int]) -> None:
    """SIGKILL, then the same port on the same AOF. `lose_last_writes`: first cut off the last
    whole writes (up to 4 kB) appended since the last start, what a node crash takes with the page
    cache under appendfsync everysec."""
    rng = random.Random(0)
    started = (_newest_aof(server), _newest_aof(server).stat().st_size)  # the file and its size at start
    while not stop.wait(rng.uniform(0.05, 0.4)):
        server.kill()
        aof = _newest_aof(server)
        if lose_last_writes:
            data = aof.read_bytes()
            ends = _whole_write_ends(data, started[1] if aof == started[0] else 0)
            os.truncate(aof, rng.choice([end for end in ends if end >= len(data) - 4096] or ends[-1:]))
        server.start()
        started = (_newest_aof(server), _newest_aof(server).stat().st_size)
        kills.append(1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lose_last_writes", [False, True], ids=["process-killed", "last-writes-lost"])
def test_rounds_finish_and_nothing_is_lost_while_redis_is_killed_again_and_again(
    redis_server, lose_last_writes
) -> None:
    """A killed redis-server loses replies (its AOF has every write); one on a crashed node also
    loses its last writes, so prompts, groups and acknowledgements are rolled back under the
    running workers and trainer. Rounds still finish, with every group once."""
    client = connect(redis_server.url)
    rollout.ensure_groups(client, KEYS)
    collector = TrajectoryCollector(client, KEYS, block_ms=50, lost_check_s=1.0)
    stop, stop_killing, errors, kills = threading.Event(), threading.Event(), [], []
    threads = [threading.Thread(target=_serve, args=(redis_server.url, f"w{i}", stop, errors)) for i in range(2)]
    killer = threading.Thread(target=_kill_now_and_then, args=(redis_server, lose_last_writes, stop_killing, kills))
    collected: set[str] = set()
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
            collected.update(r.request_id for r in reqs)
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
        stop_killing.set()
        killer.join(timeout=30)
        # A rolled-back answer puts its prompt back: the workers answer it again (dropped as late).
        deadline = time.monotonic() + 60
        while client.xlen(KEYS.prompts) + client.xlen(KEYS.eval_prompts) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    assert client.xlen(KEYS.prompts) == 0 and client.xlen(KEYS.eval_prompts) == 0  # every prompt answered
    # What the trainer still holds is a step's duplicate (its acknowledgement rolled back), never a
    # group a step went without; a late duplicate may also wait unread in the stream.
    held = [text(p["message_id"]) for p in client.xpending_range(KEYS.trajectories, TRAINER_GROUP, "-", "+", 1000)]
    for entry_id in held:
        for _, fields in client.xrange(KEYS.trajectories, entry_id, entry_id):
            assert TrajectoryGroup.model_validate_json(fields[b"data"]).request_id in collected
    if not lose_last_writes:
        assert held == []
    client.close()
