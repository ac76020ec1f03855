"""The rollout worker: a warm engine and BM25 index serving prompt requests from Redis.

Loop: reclaim prompts a dead worker held (XAUTOCLAIM past `claim_min_idle_ms`), else read new ones
from the prompt and eval-prompt streams (consumer group `rollout`); skip request ids already
answered; bring the weights to at least the batch's `min_policy_version`; generate every group of
the batch with one multi-turn rollout; publish each group and acknowledge its prompt in one
transaction. Weights are synced between batches, never during one, so every trajectory of a batch
carries one policy version. A heartbeat thread writes the worker's state into the `workers` hash
and keeps the idle time of held prompts low, so only a dead worker's prompts are reclaimed.

SIGTERM (or `stop`) ends the loop after the batch in progress; prompts held but not started (while
waiting for weights) are released back to the stream at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import redis

from rljob.agent.rollout import generate_groups
from rljob.config import RLJob
from rljob.keys import JobKeys
from rljob.queue import backlog
from rljob.queue import worker_end as streams
from rljob.queue.done import DoneSet
from rljob.redis_client import connect
from rljob.rollout.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass
class WorkerSummary:
    worker_id: str
    batches: int = 0
    groups_published: int = 0
    duplicates_skipped: int = 0
    reclaimed: int = 0
    generated_tokens: int = 0
    policy_version: int = 0
    released: int = 0


@dataclass
class _Shared:
    """State the heartbeat thread reads while the main loop works."""

    held: list[streams.HeldPrompt] = field(default_factory=list)
    busy: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _sync(engine: Any, reader: Any, summary: WorkerSummary) -> None:
    # reader.version is None until a first sync: version 0 may differ from the weights loaded at
    # start (a supervised warm-up runs before it is published), so it is applied like any other.
    # needs_sync compares publish ids too: after Redis lost its last commit, a republished version
    # can carry the number this worker already serves.
    if reader.needs_sync():
        outcome = engine.sync_weights(reader)
        log.info(
            "weights at version %d (%d tensors, %d bytes)", outcome.version, len(outcome.changed), outcome.bytes_fetched
        )
    summary.policy_version = engine.policy_version


def _wait_for_weights(engine: Any, reader: Any, need: int, stop: threading.Event, summary: WorkerSummary) -> bool:
    """Sync until the engine holds at least version `need`; False if told to stop first."""
    _sync(engine, reader, summary)  # a version published since the loop's last check (version 0 included)
    while engine.policy_version < need:
        if stop.is_set():
            return False
        try:
            reader.wait_for_version(need, timeout=1.0)
        except TimeoutError:
            continue
        _sync(engine, reader, summary)
    return True


def engine_options(job: RLJob) -> dict[str, Any]:
    """Engine arguments from the job: vLLM shards the model over every GPU of the pod."""
    gpus = job.spec.rollout.resources.gpus
    return {"tensor_parallel_size": gpus} if job.spec.rollout.engine == "vllm" and gpus > 1 else {}


def stale_workers(entries: dict, now: float, max_age_s: float) -> list[str]:
    """Workers in the heartbeat hash whose last beat is older than `max_age_s` (or unreadable)."""
    stale = []
    for name, raw in entries.items():
        try:
            fresh = now - float(json.loads(raw)["ts"]) <= max_age_s
        except (ValueError, KeyError, TypeError):
            fresh = False
        if not fresh:
            stale.append(name.decode() if isinstance(name, bytes) else name)
    return stale


def _heartbeat(
    client: redis.Redis,
    keys: JobKeys,
    worker_id: str,
    shared: _Shared,
    summary: WorkerSummary,
    metrics: WorkerMetrics,
    interval: float,
    stop: threading.Event,
) -> None:
    while True:
        try:
            with shared.lock:
                held = list(shared.held)
                busy = shared.busy
            if held:
                streams.refresh_idle(client, worker_id, held)
            state = {
                "ts": time.time(),
                "pid": os.getpid(),
                "busy": busy,
                "held": len(held),
                "policy_version": summary.policy_version,
                "groups": summary.groups_published,
            }
            client.hset(keys.workers, worker_id, json.dumps(state))
            stale = stale_workers(client.hgetall(keys.workers), time.time(), max(60.0, 10 * interval))
            if stale:  # killed workers (SIGKILL, OOM) never remove their own entry
                client.hdel(keys.workers, *stale)
            metrics.pending_prompts.set(backlog.pending_prompts(client, keys))
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
        if stop.wait(interval):
            return


def run_rollout_worker(
    job: RLJob,
    redis_url: str,
    worker_id: str,
    stop: threading.Event | None = None,
    *,
    engine: Any = None,
    retriever: Any = None,
    device: str | None = None,
    metrics_port: int | None = None,
    claim_min_idle_ms: int = 30_000,
    heartbeat_seconds: float = 5.0,
    block_ms: int = 1000,
) -> WorkerSummary:
    """Serve prompts until `stop` is set (or SIGTERM when run in the main thread without `stop`)."""
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
    keys = JobKeys(job.metadata.namespace, job.metadata.name)
    client = connect(redis_url)
    streams.ensure_groups(client, keys)
    if retriever is None:
        from rljob.retrieval import build_retriever_for_spec

        retriever = build_retriever_for_spec(job.spec.data)[0]
    if engine is None:
        import torch

        from rljob.engines import load_engine

        if not device:
            device = "cuda" if torch.cuda.is_available() and job.spec.rollout.resources.gpus > 0 else "cpu"
        seed = zlib.crc32(worker_id.encode())  # each worker draws its own samples
        engine = load_engine(job.spec.model, job.spec.rollout.engine, device, seed=seed, **engine_options(job))
    from rljob.weights import WeightReader

    reader = WeightReader(client, keys)
    metrics = WorkerMetrics(metrics_port)
    summary, shared = WorkerSummary(worker_id), _Shared()
    batch_size = job.spec.rollout.batch_size
    beat_stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat,
        name=f"heartbeat-{worker_id}",
        daemon=True,
        args=(client, keys, worker_id, shared, summary, metrics, heartbeat_seconds, beat_stop),
    )
    beat.start()
    log.info("rollout worker %s ready (batch %d)", worker_id, batch_size)
    try:
        while not stop.is_set():
            _sync(engine, reader, summary)
            metrics.weight_version.set(engine.policy_version)
            held = streams.reclaim_stale(client, keys, worker_id, claim_min_idle_ms, batch_size)
            summary.reclaimed += len(held)
            if not held:
                held = streams.read_new(client, keys, worker_id, batch_size, block_ms)
            if not held:
                continue
            if stop.is_set():  # stopped while reading: these are held, not started; hand them back
                streams.release(client, held)
                summary.released += len(held)
                break
            with shared.lock:
                shared.held, shared.busy = list(held), True
            _serve_batch(client, keys, engine, reader, retriever, job, worker_id, held, stop, summary, metrics)
            with shared.lock:
                shared.held, shared.busy = [], False
    finally:
        beat_stop.set()
        beat.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            client.hdel(keys.workers, worker_id)
        metrics.close()
        client.close()
    log.info("rollout worker %s stopped: %s", worker_id, summary)
    return summary


def _serve_batch(
    client: redis.Redis,
    keys: JobKeys,
    engine: Any,
    reader: Any,
    retriever: Any,
    job: RLJob,
    worker_id: str,
    held: list[streams.HeldPrompt],
    stop: threading.Event,
    summary: WorkerSummary,
    metrics: WorkerMetrics,
) -> None:
    broken = [h for h in held if h.request is None]
    streams.reject(client, keys, broken)  # answered with a rejection: poison entries would come back forever
    held = [h for h in held if h.request is not None]
    done = DoneSet(client, keys).answered([h.request.request_id for h in held])
    duplicates = [h for h in held if h.request.request_id in done]
    streams.acknowledge(client, duplicates)
    summary.duplicates_skipped += len(duplicates)
    held = [h for h in held if h.request.request_id not in done]
    if not held:
        return
    need = max(h.request.min_policy_version for h in held)
    if not _wait_for_weights(engine, reader, need, stop, summary):
        streams.release(client, held)
        summary.released += len(held)
        return
    started = time.perf_counter()
    groups = generate_groups(engine, retriever, [h.request for h in held], job.spec.agent, worker_id=worker_id)
    seconds = time.perf_counter() - started
    tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
    for prompt, group in zip(held, groups, strict=True):
        if streams.publish_group(client, keys, prompt, group):
            summary.groups_published += 1
            metrics.trajectories.inc(len(group.trajectories))
        else:
            summary.duplicates_skipped += 1
    summary.batches += 1
    summary.generated_tokens += tokens
    metrics.generated_tokens.inc(tokens)
    metrics.tokens_per_second.set(tokens / max(seconds, 1e-9))
