"""Rollout workers against a real redis-server: exactly one group per prompt, even across a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
import yaml

from rljob.assets import hotpotqa_file
from rljob.config import RLJob
from rljob.data.hotpotqa import load_questions
from rljob.engines.hf import HFEngine
from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup
from rljob.retrieval import Retriever
from rljob.rollout.worker import run_rollout_worker
from support.tiny_models import save_tiny_model, tiny_random_model, train_tiny_tokenizer

pytestmark = pytest.mark.integration


def _job(model_dir: str) -> RLJob:
    return RLJob.model_validate(
        {
            "metadata": {"name": "t", "namespace": "ns"},
            "spec": {
                "model": {"name": model_dir, "dtype": "float32"},
                "data": {
                    "trainPath": str(hotpotqa_file("train.jsonl")),
                    "evalPath": str(hotpotqa_file("dev.jsonl")),
                    "maxTrainQuestions": 40,
                },
                "agent": {"maxTurns": 2, "maxNewTokensPerTurn": 16, "maxTotalTokens": 800},
                "rollout": {"batchSize": 2},
            },
        }
    )


def _enqueue(client, keys: JobKeys, questions, group_size: int, eval_count: int) -> list[str]:
    """All prompts in one MULTI/EXEC: a worker blocked in its read wakes once, seeing them all (with
    one XADD at a time it could wake after the first, and tests counting what one read got raced)."""
    ids = []
    with client.pipeline(transaction=True) as pipe:
        for i, q in enumerate(questions):
            is_eval = i < eval_count
            req = PromptRequest(
                request_id=f"{'e' if is_eval else 's'}{i}",
                step=0,
                question_id=q.id,
                question=q.question,
                answers=q.answers,
                group_size=group_size,
                greedy=is_eval,
            )
            pipe.xadd(keys.eval_prompts if is_eval else keys.prompts, {"data": req.model_dump_json()})
            ids.append(req.request_id)
        pipe.execute()
    return ids


def _groups(client, stream: str) -> list[TrajectoryGroup]:
    return [TrajectoryGroup.model_validate_json(f[b"data"]) for _, f in client.xrange(stream)]


def _pending(client, stream: str, consumer: str | None = None) -> list[str]:
    try:
        rows = client.xpending_range(stream, ROLLOUT_GROUP, "-", "+", 1000, consumername=consumer)
    except redis.ResponseError:  # the workers have not created the group yet
        return []
    return [r["message_id"].decode() for r in rows]


def test_in_process_worker_dedupes_and_stops(redis_server, redis_client) -> None:
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=40)
    tokenizer = train_tiny_tokenizer(
        [q.question for q in questions] + [p.text for q in questions[:10] for p in q.context]
    )
    engine = HFEngine(tiny_random_model(tokenizer), tokenizer, seed=0)
    job = _job("unused")
    keys = JobKeys("ns", "t")
    ids = _enqueue(redis_client, keys, questions[:3], group_size=2, eval_count=1)
    again = PromptRequest(request_id="s1", step=0, question_id="x", question="dup?", answers=["a"], group_size=2)
    stop = threading.Event()
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            s=run_rollout_worker(
                job,
                redis_server.url,
                "w0",
                stop,
                engine=engine,
                retriever=Retriever.from_questions(questions),
                heartbeat_seconds=0.2,
                block_ms=100,
            )
        )
    )
    thread.start()
    deadline = time.monotonic() + 60
    while redis_client.xlen(keys.trajectories) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    redis_client.xadd(keys.prompts, {"data": again.model_dump_json()})  # a redelivered request id
    redis_client.xadd(keys.prompts, {"data": "not json"})
    deadline = time.monotonic() + 30
    while _pending(redis_client, keys.prompts) or redis_client.xlen(keys.prompts):  # answered prompts are deleted
        assert time.monotonic() < deadline
        time.sleep(0.1)
    heartbeat = json.loads(redis_client.hget(keys.workers, "w0"))
    assert heartbeat["pid"] == os.getpid()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    summary = result["s"]
    assert summary.groups_published == 3 and summary.duplicates_skipped == 1
    sampled, evaluated = _groups(redis_client, keys.trajectories), _groups(redis_client, keys.eval_results)
    assert sorted(g.request_id for g in sampled + evaluated) == sorted(ids)
    assert [g.request_id for g in evaluated] == ["e0"]
    assert all(len(g.trajectories) == 2 and g.worker_id == "w0" for g in sampled + evaluated)
    info = {g["name"].decode(): g for g in redis_client.xinfo_groups(keys.prompts)}[ROLLOUT_GROUP]
    assert info["pending"] == 0 and info["lag"] == 0
    assert redis_client.xlen(keys.prompts) == redis_client.xlen(keys.eval_prompts) == 0  # nothing left behind
    assert redis_client.hget(keys.workers, "w0") is None  # a clean exit removes the heartbeat


def test_prompts_read_as_the_worker_stops_are_handed_back_not_served(redis_server, redis_client) -> None:
    # SIGTERM during the blocking read: the prompts that read returns are held but not started,
    # so they go back to the stream at once (they were generated in full before, delaying the stop).
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=10)
    tokenizer = train_tiny_tokenizer([q.question for q in questions])
    engine = HFEngine(tiny_random_model(tokenizer), tokenizer, seed=0)
    keys = JobKeys("ns", "t")
    stop = threading.Event()
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            s=run_rollout_worker(
                _job("unused"),
                redis_server.url,
                "w0",
                stop,
                engine=engine,
                retriever=Retriever.from_questions(questions),
                heartbeat_seconds=0.2,
                block_ms=3000,
            )
        )
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not any(c.get("cmd") == "xread" for c in redis_client.client_list()):  # blocked in its read
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stop.set()
    ids = _enqueue(redis_client, keys, questions[:2], group_size=2, eval_count=0)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["s"].released == 2 and result["s"].groups_published == 0
    assert redis_client.xlen(keys.trajectories) == 0
    back = [PromptRequest.model_validate_json(f[b"data"]).request_id for _, f in redis_client.xrange(keys.prompts)]
    assert sorted(back) == sorted(ids) and _pending(redis_client, keys.prompts) == []


@pytest.mark.slow
def test_two_workers_one_killed_mid_batch(redis_server, redis_client, tmp_path) -> None:
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=60)
    texts = [q.question for q in questions] + [p.text for q in questions[:20] for p in q.context]
    model_dir = save_tiny_model(tmp_path / "tiny", texts, vocab_size=400)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(_job(str(model_dir)).model_dump(by_alias=True, mode="json")))
    keys = JobKeys("ns", "t")
    ids = _enqueue(redis_client, keys, questions[:8], group_size=2, eval_count=2)

    def spawn(worker_id: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "support.rollout_worker",
            "--job",
            str(job_path),
            "--redis-url",
            redis_server.url,
            "--worker-id",
            worker_id,
            "--claim-min-idle-ms",
            "1500",
            "--heartbeat-seconds",
            "0.3",
            "--threads",
            "1",
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{worker_id}.log", "wb"))

    # The victim starts alone so it surely holds work. It is frozen (SIGSTOP) before we read what
    # it holds: a worker answers and acknowledges in one transaction, so a frozen worker's pending
    # entries are exactly the prompts it has not answered. Reading while it runs raced: on a fast
    # machine it answered them all between our look and the kill, and nothing was left to recover.
    def victim_holds() -> list[str]:
        return _pending(redis_client, keys.prompts, "victim") + _pending(redis_client, keys.eval_prompts, "victim")

    victim = spawn("victim")
    survivor = None
    try:
        deadline = time.monotonic() + 120
        held: list[str] = []
        while not held:
            assert time.monotonic() < deadline, (tmp_path / "victim.log").read_text()[-3000:]
            assert victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
            if victim_holds():
                victim.send_signal(signal.SIGSTOP)
                held = victim_holds()
                if not held:  # it answered them just before it froze: look again
                    victim.send_signal(signal.SIGCONT)
            time.sleep(0.05)
        held_requests = {
            json.loads(f[b"data"])["request_id"]
            for stream in (keys.prompts, keys.eval_prompts)
            for entry_id, f in redis_client.xrange(stream)
            if entry_id.decode() in held
        }
        survivor = spawn("survivor")
        victim.send_signal(signal.SIGKILL)  # mid-batch: it holds prompts it has not answered
        victim.wait(timeout=10)
        deadline = time.monotonic() + 180
        while True:
            answered = _groups(redis_client, keys.trajectories) + _groups(redis_client, keys.eval_results)
            if len({g.request_id for g in answered}) == len(ids):
                break
            assert time.monotonic() < deadline, (tmp_path / "survivor.log").read_text()[-3000:]
            assert survivor.poll() is None, (tmp_path / "survivor.log").read_text()[-3000:]
            time.sleep(0.2)
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=60) == 0
    finally:
        for proc in (victim, survivor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    answered = _groups(redis_client, keys.trajectories) + _groups(redis_client, keys.eval_results)
    assert sorted(g.request_id for g in answered) == sorted(ids)  # every prompt exactly once
    assert all(len(g.trajectories) == 2 for g in answered)
    by_request = {g.request_id: g.worker_id for g in answered}
    assert held_requests and all(by_request[r] == "survivor" for r in held_requests)
    for stream in (keys.prompts, keys.eval_prompts):
        assert _pending(redis_client, stream) == [] and redis_client.xlen(stream) == 0
    assert redis_client.hget(keys.workers, "survivor") is None


def test_a_worker_rides_out_a_redis_restart(redis_server, redis_client) -> None:
    # The job's Redis restarts (node drained, OOM-killed, spec changed): with redis-py's default
    # retry the worker failed on its next command. Prompts enqueued before and after the restart
    # are all answered by the same worker process, exactly once.
    redis_client.config_set("appendfsync", "always")  # this test's writes must survive the kill
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=20)
    tokenizer = train_tiny_tokenizer(
        [q.question for q in questions] + [p.text for q in questions[:5] for p in q.context]
    )
    engine = HFEngine(tiny_random_model(tokenizer), tokenizer, seed=0)
    keys = JobKeys("ns", "t")
    before = _enqueue(redis_client, keys, questions[:2], group_size=2, eval_count=0)
    stop, result = threading.Event(), {}
    thread = threading.Thread(
        target=lambda: result.update(
            s=run_rollout_worker(
                _job("unused"),
                redis_server.url,
                "w0",
                stop,
                engine=engine,
                retriever=Retriever.from_questions(questions),
                heartbeat_seconds=0.2,
                block_ms=100,
            )
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while redis_client.xlen(keys.trajectories) < len(before):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.1)
        redis_server.kill()
        time.sleep(1.5)  # down for a while: the worker's reads fail and are retried meanwhile
        redis_server.start()
        client = redis.Redis.from_url(redis_server.url)
        client.config_set("appendfsync", "always")
        after = [f"after-{i}" for i in range(2)]
        for request_id, q in zip(after, questions[2:4], strict=True):
            req = PromptRequest(
                request_id=request_id, step=0, question_id=q.id, question=q.question, answers=q.answers, group_size=2
            )
            client.xadd(keys.prompts, {"data": req.model_dump_json()})
        deadline = time.monotonic() + 60
        while len(_groups(client, keys.trajectories)) < len(before) + len(after):
            assert time.monotonic() < deadline and thread.is_alive(), "the worker did not come back"
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and "s" in result  # it stopped cleanly, not on an error
    assert sorted(g.request_id for g in _groups(client, keys.trajectories)) == sorted(before + after)
    client.close()
