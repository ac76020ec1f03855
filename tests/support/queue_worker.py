"""A rollout worker without a model, for queue tests: the real read / reclaim / publish path,
answering each prompt with a fixed group of about a real one's size."""

from __future__ import annotations

import threading

import redis

from rljob.keys import JobKeys
from rljob.protocol import PromptRequest, Trajectory, TrajectoryGroup
from rljob.queue import worker_end as rollout


def fake_group(req: PromptRequest, worker: str = "w", tokens: int = 256) -> TrajectoryGroup:
    """A group about the size of a real one (a few tens of kB of JSON)."""
    traj = Trajectory(
        token_ids=list(range(tokens)),
        prompt_length=64,
        loss_mask=[0] * 64 + [1] * (tokens - 64),
        behaviour_logprobs=[0.0] * 64 + [-0.123456789] * (tokens - 64),
        policy_version=0,
    )
    return TrajectoryGroup(
        request_id=req.request_id,
        step=req.step,
        question_id=req.question_id,
        worker_id=worker,
        trajectories=[traj] * req.group_size,
    )


def serve_without_model(
    client: redis.Redis,
    keys: JobKeys,
    worker: str,
    stop: threading.Event,
    errors: list[BaseException],
    *,
    count: int = 3,
    reclaim_idle_ms: int | None = None,
    pause_s: float = 0.0,
) -> None:
    """Serve until `stop`; what it raises goes to `errors` (a thread's failure the test surfaces).
    `reclaim_idle_ms`: take over prompts held that long first, as a worker does after a crash.
    `pause_s`: a stand-in for generation, so reads and writes of several workers interleave."""
    try:
        while not stop.is_set():
            held = rollout.reclaim_stale(client, keys, worker, reclaim_idle_ms, count) if reclaim_idle_ms else []
            held = held or rollout.read_new(client, keys, worker, count=count, block_ms=50)
            rollout.acknowledge(client, [h for h in held if h.request is None])
            for h in held:
                if h.request is not None:
                    stop.wait(pause_s)
                    rollout.publish_group(client, keys, h, fake_group(h.request, worker))
    except BaseException as exc:
        errors.append(exc)
    finally:
        client.close()
