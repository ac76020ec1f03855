"""Redis stream plumbing of the rollout worker: read, reclaim, publish exactly once, release.

Exactly-once output rests on two things. Publishing is one MULTI/EXEC transaction (XADD the group,
SADD its request id to the done set, XACK the prompt) guarded by WATCH on the done set, so a crash
can leave the prompt either unanswered and pending (to be reclaimed) or answered and acknowledged,
never answered twice. And a request id already in the done set is only acknowledged, which covers a
slow worker whose prompt was reclaimed and answered by another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldPrompt:
    """A prompt this worker has read and not yet acknowledged."""

    stream: str
    entry_id: str
    data: bytes
    request: PromptRequest | None  # None: the entry could not be parsed

    @property
    def is_eval(self) -> bool:
        return self.stream.endswith("eval:prompts")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ensure_groups(client: redis.Redis, keys: JobKeys) -> None:
    for stream in (keys.prompts, keys.eval_prompts):
        try:
            client.xgroup_create(stream, ROLLOUT_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def _held(stream: str, entry_id: bytes | str, fields: dict) -> HeldPrompt:
    data = fields.get(b"data", fields.get("data", b""))
    data = data.encode() if isinstance(data, str) else data
    try:
        request: PromptRequest | None = PromptRequest.model_validate_json(data)
    except ValueError as exc:
        log.error("dropping unparsable prompt %s on %s: %s", _text(entry_id), stream, exc)
        request = None
    return HeldPrompt(stream, _text(entry_id), data, request)


def reclaim_stale(client: redis.Redis, keys: JobKeys, consumer: str, min_idle_ms: int, count: int) -> list[HeldPrompt]:
    """Take over prompts another consumer has held longer than `min_idle_ms` (it died)."""
    taken: list[HeldPrompt] = []
    for stream in (keys.prompts, keys.eval_prompts):
        if len(taken) >= count:
            break
        reply = client.xautoclaim(stream, ROLLOUT_GROUP, consumer, min_idle_ms, "0-0", count=count - len(taken))
        for entry_id, fields in reply[1]:
            if fields is not None:  # deleted entries come back empty and leave the pending list
                taken.append(_held(stream, entry_id, fields))
    if taken:
        log.warning("%s reclaimed %d prompts from a dead worker", consumer, len(taken))
    return taken


def read_new(client: redis.Redis, keys: JobKeys, consumer: str, count: int, block_ms: int) -> list[HeldPrompt]:
    reply = client.xreadgroup(
        ROLLOUT_GROUP, consumer, {keys.eval_prompts: ">", keys.prompts: ">"}, count=count, block=block_ms
    )
    return [_held(_text(stream), entry_id, fields) for stream, entries in reply or [] for entry_id, fields in entries]


def refresh_idle(client: redis.Redis, consumer: str, held: list[HeldPrompt]) -> None:
    """Re-claim our own entries (JUSTID, idle 0): resets their idle time so no live work is stolen."""
    by_stream: dict[str, list[str]] = {}
    for h in held:
        by_stream.setdefault(h.stream, []).append(h.entry_id)
    for stream, ids in by_stream.items():
        client.xclaim(stream, ROLLOUT_GROUP, consumer, 0, ids, justid=True)


def done_request_ids(client: redis.Redis, keys: JobKeys, request_ids: list[str]) -> set[str]:
    if not request_ids:
        return set()
    flags = client.smismember(keys.rollout_done, request_ids)
    return {rid for rid, flag in zip(request_ids, flags, strict=True) if flag}


def acknowledge(client: redis.Redis, held: list[HeldPrompt]) -> None:
    for h in held:
        client.xack(h.stream, ROLLOUT_GROUP, h.entry_id)


def publish_group(client: redis.Redis, keys: JobKeys, prompt: HeldPrompt, group: TrajectoryGroup) -> bool:
    """Append the group and acknowledge its prompt atomically; False when it was already answered."""
    out = keys.eval_results if prompt.is_eval else keys.trajectories
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.rollout_done)
                already = bool(pipe.sismember(keys.rollout_done, group.request_id))
                pipe.multi()
                if not already:
                    pipe.xadd(out, {"data": group.model_dump_json()})
                    pipe.sadd(keys.rollout_done, group.request_id)
                pipe.xack(prompt.stream, ROLLOUT_GROUP, prompt.entry_id)
                pipe.execute()
                return not already
            except redis.WatchError:
                continue  # another worker published meanwhile: look again


def release(client: redis.Redis, held: list[HeldPrompt]) -> None:
    """Hand prompts back at once (re-queue + ack in one transaction) instead of waiting for reclaim."""
    for h in held:
        with client.pipeline(transaction=True) as pipe:
            pipe.xadd(h.stream, {"data": h.data})
            pipe.xack(h.stream, ROLLOUT_GROUP, h.entry_id)
            pipe.execute()


def pending_prompts(client: redis.Redis, keys: JobKeys) -> int:
    """Prompts not yet answered: never delivered (lag) plus delivered and unacknowledged."""
    total = 0
    for stream in (keys.prompts, keys.eval_prompts):
        for group in client.xinfo_groups(stream):
            name = _text(group.get("name", b""))
            if name == ROLLOUT_GROUP:
                total += int(group.get("pending") or 0) + int(group.get("lag") or 0)
    return total
