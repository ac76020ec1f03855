"""run_trainer against a real redis-server, real weight store and a rollout responder built from the
project's real agent, engine and retrieval pieces (a tiny random model, HotpotQA sample questions)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis

from rljob.assets import hotpotqa_file
from rljob.config import RLJob
from rljob.keys import TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrainerMetrics
from rljob.trainer.loop import run_trainer

pytestmark = pytest.mark.integration


def _job(model_dir: Path, total_steps: int, lag: int = 0) -> RLJob:
    return RLJob.model_validate(
        {
            "metadata": {"name": "grpo-it", "namespace": "test"},
            "spec": {
                "model": {"name": str(model_dir)},
                "data": {
                    "trainPath": str(hotpotqa_file("train.jsonl")),
                    "evalPath": str(hotpotqa_file("dev.jsonl")),
                    "maxTrainQuestions": 6,
                    "corpusFrom": "train",
                },
                "agent": {
                    "maxTurns": 2,
                    "topK": 1,
                    "maxNewTokensPerTurn": 8,
                    "maxTotalTokens": 1024,
                    "passageMaxWords": 12,
                    "reward": "f1",
                    "formatReward": 0.2,
                    "searchReward": 0.1,
                },
                "grpo": {
                    "groupSize": 3,
                    "questionsPerStep": 2,
                    "learningRate": 1e-3,
                    "microBatchSize": 4,
                    "totalSteps": total_steps,
                    "checkpointInterval": 2,
                    "maxPolicyLag": lag,
                },
                "eval": {"interval": 2, "questions": 2},
                "weightSync": {"chunkBytes": 65536},
            },
        }
    )


def _start_responder(
    url: str, job: RLJob, stop: threading.Event, errors: list[BaseException], reward=None
) -> threading.Thread:
    """A rollout worker in miniature: prompts in, real multi-turn episodes out, weights synced.

    The model is loaded here, before the thread starts: transformers' loading is not thread-safe.
    """
    from rljob.engines.hf import HFEngine
    from rljob.retrieval.retriever import build_retriever_for_spec

    engine = HFEngine.from_spec(job.spec.model, seed=0)
    retriever, _, _ = build_retriever_for_spec(job.spec.data)
    score = reward or (lambda group, t: _toy_reward(t))
    thread = threading.Thread(target=_serve, args=(url, job, engine, retriever, stop, errors, score), daemon=True)
    thread.start()
    return thread


def _serve(url: str, job: RLJob, engine, retriever, stop: threading.Event, errors: list[BaseException], score) -> None:
    try:
        from rljob.agent.rollout import generate_groups
        from rljob.queue.worker_end import ensure_groups, publish_group, read_new
        from rljob.weights import WeightReader

        keys = JobKeys(job.metadata.namespace, job.metadata.name)
        client = redis.Redis.from_url(url)
        reader = WeightReader(client, keys)
        ensure_groups(client, keys)
        while not stop.is_set():
            held = [h for h in read_new(client, keys, "it-worker", count=8, block_ms=100) if h.request]
            if not held:
                continue
            need = max(h.request.min_policy_version for h in held)
            while (reader.latest_version() or 0) < need and not stop.is_set():
                time.sleep(0.02)
            engine.sync_weights(reader)
            groups = generate_groups(engine, retriever, [h.request for h in held], job.spec.agent, "it-worker")
            for g in groups:
                for t in g.trajectories:
                    t.reward = score(g, t)
            for h, g in zip(held, groups, strict=True):
                publish_group(client, keys, h, g)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def _toy_reward(t) -> float:
    """A random tiny model never earns the real (answer) reward, so every group would be all-zero and
    the loop would never update. Rescore with a reward it can earn: the share of generated tokens
    with an even id. Everything else (episodes, masks, behaviour log-probs) is the real thing."""
    generated = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    return sum(tok % 2 == 0 for tok in generated) / max(len(generated), 1)


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    from rljob.data import load_questions
    from support.tiny_models import save_tiny_model

    texts = [q.question for q in load_questions(hotpotqa_file("train.jsonl"), limit=200)]
    texts += ["<search> </search> <answer> </answer> <information> </information> <think> </think>"] * 20
    return save_tiny_model(tmp_path / "tiny", texts, vocab_size=400)


def lines_of(results: Path) -> list[dict]:
    return [json.loads(x) for x in (results / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def sent_prompts(monkeypatch: pytest.MonkeyPatch) -> list[PromptRequest]:
    """Training prompts as the trainer enqueues them: answered ones leave the stream, so record them."""
    import rljob.queue.trainer_end as trainer_streams

    sent: list[PromptRequest] = []
    enqueue = trainer_streams.enqueue_prompts

    def recording(client: redis.Redis, stream: str, requests) -> None:
        if stream.endswith("}:prompts"):
            sent.extend(requests)
        enqueue(client, stream, requests)

    monkeypatch.setattr(trainer_streams, "enqueue_prompts", recording)
    return sent


def _assert_streams_empty(client: redis.Redis, keys: JobKeys) -> None:
    """Every entry consumed and acknowledged is deleted: nothing piles up in a noeviction Redis."""
    streams = (keys.prompts, keys.eval_prompts, keys.trajectories, keys.eval_results)
    assert {s: client.xlen(s) for s in streams} == dict.fromkeys(streams, 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trains_publishes_evaluates_checkpoints_and_resumes(
    redis_server, tiny_model_dir: Path, tmp_path: Path, sent_prompts: list[PromptRequest]
):
    job = _job(tiny_model_dir, total_steps=3)
    keys = JobKeys("test", "grpo-it")
    client = redis.Redis.from_url(redis_server.url)
    stop, errors = threading.Event(), []
    worker = _start_responder(redis_server.url, job, stop, errors)
    ckpt, results = tmp_path / "ckpt", tmp_path / "results"
    try:
        run_trainer(job, redis_server.url, str(ckpt), results_dir=str(results), progress=False)
        m = TrainerMetrics.from_redis(client.hgetall(keys.metrics))
        assert m.state == "succeeded" and m.step == 3 and m.total_steps == 3
        assert m.policy_version == 3 and m.weight_bytes > 0
        # interval 2 over 3 steps: evals at 0 (before training), 2, and 3 (the last step always)
        assert m.eval_step == 3 and m.eval_exact_match is not None and m.eval_f1 is not None
        assert json.loads((results / "eval_before.json").read_text())["step"] == 0
        assert json.loads((results / "eval_after.json").read_text())["step"] == 3
        assert [x.get("eval_step") for x in lines_of(results)] == [0, 2, 3]
        lines = [json.loads(x) for x in (results / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3]
        assert [x["policy_version"] for x in lines] == [1, 2, 3]
        # version 0 was the full export; whether a later one rebases is the weight store's call
        assert all(x["weight_kind"] in ("delta", "full") for x in lines), lines
        assert all(x["train_updated"] and x["train_tokens"] > 0 for x in lines)
        assert all(x["weight_changed"] > 0 for x in lines)  # the deltas carry the updates
        assert all(x["wait_seconds"] > 0 and x["train_seconds"] > 0 for x in lines)
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]
        # synchronous mode: step k's prompts wait for version k; each question once per step
        prompts = list(sent_prompts)
        assert [(p.step, p.min_policy_version) for p in prompts] == [(k, k) for k in range(3) for _ in range(2)]
        assert len({p.request_id for p in prompts}) == 6
        assert client.xpending(keys.trajectories, TRAINER_GROUP)["pending"] == 0  # all acknowledged
        _assert_streams_empty(client, keys)

        # A new gang process with a longer horizon resumes from the step-3 checkpoint.
        run_trainer(_job(tiny_model_dir, total_steps=4), redis_server.url, str(ckpt), progress=False)
        m = TrainerMetrics.from_redis(client.hgetall(keys.metrics))
        assert m.state == "succeeded" and m.step == 4
        assert m.policy_version == 5  # 4: the resumed weights re-published, 5: after step 4
        resumed = sent_prompts[6:]
        assert [p.step for p in resumed] == [3, 3] and all(p.min_policy_version == 4 for p in resumed)
        _assert_streams_empty(client, keys)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not errors, errors


@pytest.mark.timeout(120)
def test_a_failure_is_recorded_in_the_metrics_hash(redis_server, tmp_path: Path):
    job = _job(tmp_path / "no-such-model", total_steps=1)
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises, it must surface
        run_trainer(job, redis_server.url, str(tmp_path / "ckpt"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    m = TrainerMetrics.from_redis(client.hgetall(JobKeys("test", "grpo-it").metrics))
    assert m.state == "failed" and m.message


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_policy_lag_pipelines_prompts_ahead(
    redis_server, tiny_model_dir: Path, tmp_path: Path, sent_prompts: list[PromptRequest], monkeypatch
):
    """Against the project's own rollout worker (real rewards: all zero for a random model, which is
    fine here: this test is about which prompts go out when, not about learning)."""
    from rljob.engines.hf import HFEngine
    from rljob.queue.trainer_end import TrajectoryCollector
    from rljob.retrieval.retriever import build_retriever_for_spec
    from rljob.rollout.worker import run_rollout_worker

    trained: list = []  # the groups the trainer used (the stream keeps none once acknowledged)
    collect = TrajectoryCollector.collect

    def recording(self, *args, **kwargs):
        groups, entry_ids = collect(self, *args, **kwargs)
        trained.extend(groups)
        return groups, entry_ids

    monkeypatch.setattr(TrajectoryCollector, "collect", recording)
    job = _job(tiny_model_dir, total_steps=3, lag=1)
    job.spec.eval.interval = 0
    keys = JobKeys("test", "grpo-it")
    client = redis.Redis.from_url(redis_server.url)
    engine = HFEngine.from_spec(job.spec.model, seed=0)  # loaded here: model loading is not thread-safe
    retriever, _, _ = build_retriever_for_spec(job.spec.data)
    stop = threading.Event()
    worker = threading.Thread(
        target=run_rollout_worker,
        args=(job, redis_server.url, "it-worker", stop),
        kwargs={"engine": engine, "retriever": retriever, "block_ms": 100, "heartbeat_seconds": 1.0},
        daemon=True,
    )
    worker.start()
    try:
        run_trainer(job, redis_server.url, str(tmp_path / "ckpt"), progress=False)
    finally:
        stop.set()
        worker.join(timeout=30)
    m = TrainerMetrics.from_redis(client.hgetall(keys.metrics))
    assert m.state == "succeeded" and m.step == 3 and m.policy_version == 3 and m.eval_step == -1
    # steps 0 and 1 go out before any update; step k+1 goes out while step k trains, needing version k
    prompts = list(sent_prompts)
    assert [(p.step, p.min_policy_version) for p in prompts] == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 1), (2, 1)]
    assert len(trained) == 6
    for g in trained:  # every sample was within the allowed lag of the version it trained
        assert all(t.policy_version >= g.step - 1 for t in g.trajectories)
    _assert_streams_empty(client, keys)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dynamic_sampling_refills_degenerate_steps_and_counts_them(
    redis_server, tiny_model_dir: Path, tmp_path: Path, sent_prompts: list[PromptRequest]
):
    """A step's own prompts all come back degenerate (every sample scores 0); with dynamicSampling
    the trainer asks for refill prompts until it has questionsPerStep informative groups, and the
    groups generated and dropped are counted in the metrics (and so in the RLJob status)."""
    job = _job(tiny_model_dir, total_steps=2)
    job.spec.grpo.dynamic_sampling, job.spec.grpo.max_refill_rounds = True, 3
    job.spec.eval.interval = 0
    keys = JobKeys("test", "grpo-it")
    client = redis.Redis.from_url(redis_server.url)
    stop, errors = threading.Event(), []

    def reward(group, t) -> float:  # refills ("-x<round>-") earn the toy reward, first asks nothing
        return _toy_reward(t) if "-x" in group.request_id else 0.0

    worker = _start_responder(redis_server.url, job, stop, errors, reward)
    try:
        run_trainer(job, redis_server.url, str(tmp_path / "ckpt"), results_dir=str(tmp_path / "r"), progress=False)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not errors, errors
    lines = lines_of(tmp_path / "r")
    assert len(lines) == 2
    for line in lines:
        assert 1 <= line["refill_rounds"] <= 3 and line["groups_generated"] >= 4
        assert line["groups_informative"] == 2 or line["refill_rounds"] == 3
        assert line["train_degenerate_groups"] == line["groups_generated"] - line["groups_informative"]
    m = TrainerMetrics.from_redis(client.hgetall(keys.metrics))
    assert m.groups_generated_total == sum(x["groups_generated"] for x in lines)
    assert m.groups_dropped_total == sum(x["groups_generated"] - x["groups_informative"] for x in lines)
    refills = [p for p in sent_prompts if "-x" in p.request_id]
    assert refills and all(p.step in (0, 1) for p in refills)
    assert len({p.request_id for p in sent_prompts}) == len(sent_prompts)
    _assert_streams_empty(client, keys)
