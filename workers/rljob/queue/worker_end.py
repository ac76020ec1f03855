"""The rollout workers' end of the queue: read, reclaim, publish exactly once, release.

Exactly-once output rests on two things. Publishing is one MULTI/EXEC transaction (XADD the group,
SADD its request id to the done set, XACK the prompt) guarded by WATCH on the done set, so a crash
can leave the prompt either unanswered and pending (to be reclaimed) or answered and acknowledged,
never answered twice. And a request id already in the done set is only acknowledged, which covers a
slow worker whose prompt was reclaimed and answered by another.

Retention (see `rljob.queue`): a prompt entry is deleted in the same transaction that acknowledges
it, and only then, so a prompt held by a worker that dies stays pending, to be reclaimed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup
from rljob.queue.done import DoneSet
from rljob.queue.wire import DATA, REASON, REJECTED, ensure_group, entry_field, request_id_of, text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldPrompt:
    """A prompt this worker has read and not yet acknowledged."""

    stream: str
    entry_id: str
    data: bytes
    request: PromptRequest | None  # None: the entry could not be parsed
    error: str = ""  # why not

    @property
    def is_eval(self) -> bool:
        return self.stream.endswith("eval:prompts")


def ensure_groups(client: redis.Redis, keys: JobKeys) -> None:
    for stream in (keys.prompts, keys.eval_prompts):
        ensure_group(client, stream, ROLLOUT_GROUP)


def _held(stream: str, entry_id: bytes | str, fields: dict) -> HeldPrompt:
    data = entry_field(fields, DATA) or b""
    data = data.encode() if isinstance(data, str) else data
    try:
        request: PromptRequest | None = PromptRequest.model_validate_json(data)
    except ValueError as exc:
        log.error("rejecting unparsable prompt %s on %s: %s", text(entry_id), stream, exc)
        return HeldPrompt(stream, text(entry_id), data, None, f"{type(exc).__name__}: {exc}"[:500])
    return HeldPrompt(stream, text(entry_id), data, request)


def reclaim_stale(client: redis.Redis, keys: JobKeys, consumer: str, min_idle_ms: int, count: int) -> list[HeldPrompt]:
    """Take over prompts another consumer has held longer than `min_idle_ms` (it died).

    XAUTOCLAIM looks at no more than ten times COUNT pending entries per call, so the scan follows
    its cursor through the whole pending list: a dead worker's prompts may queue behind many that
    live workers hold."""
    taken: list[HeldPrompt] = []
    for stream in (keys.prompts, keys.eval_prompts):
        cursor = "0-0"
        while len(taken) < count:
            reply = client.xautoclaim(stream, ROLLOUT_GROUP, consumer, min_idle_ms, cursor, count=count - len(taken))
            for entry_id, fields in reply[1]:
                if fields is not None:  # deleted entries come back empty and leave the pending list
                    taken.append(_held(stream, entry_id, fields))
            cursor = text(reply[0])
            if cursor == "0-0":  # the whole pending list was seen
                break
    if taken:
        log.warning("%s reclaimed %d prompts from a dead worker", consumer, len(taken))
    return taken


def _take(client: redis.Redis, stream: str, consumer: str, count: int) -> list[HeldPrompt]:
    reply = client.xreadgroup(ROLLOUT_GROUP, consumer, {stream: ">"}, count=count)
    return [_held(stream, entry_id, fields) for _, entries in reply or [] for entry_id, fields in entries]


def _take_up_to(client: redis.Redis, keys: JobKeys, consumer: str, count: int) -> list[HeldPrompt]:
    """At most `count` new prompts, evaluation ones first. One XREADGROUP over both streams would
    apply COUNT per stream and could take twice the batch."""
    taken = _take(client, keys.eval_prompts, consumer, count)
    if len(taken) < count:
        taken += _take(client, keys.prompts, consumer, count - len(taken))
    return taken


def _last_delivered(client: redis.Redis, stream: str) -> str:
    for group in client.xinfo_groups(stream):
        if text(group.get("name", b"")) == ROLLOUT_GROUP:
            return text(group.get("last-delivered-id", b"0-0"))
    return "0-0"


def read_new(client: redis.Redis, keys: JobKeys, consumer: str, count: int, block_ms: int) -> list[HeldPrompt]:
    """Up to `count` new prompts, waiting up to `block_ms` for some to arrive.

    The wait is a plain XREAD past each group's last-delivered id: it consumes nothing, so the
    batch limit holds, and a prompt added after our first look still ends the wait at once."""
    taken = _take_up_to(client, keys, consumer, count)
    if taken or block_ms <= 0:
        return taken
    since = {stream: _last_delivered(client, stream) for stream in (keys.eval_prompts, keys.prompts)}
    if client.xread(since, count=1, block=block_ms):
        taken = _take_up_to(client, keys, consumer, count)
    return taken  # empty when another worker was faster


def refresh_idle(client: redis.Redis, consumer: str, held: list[HeldPrompt]) -> None:
    """Re-claim our own entries (JUSTID, idle 0): resets their idle time so no live work is stolen."""
    by_stream: dict[str, list[str]] = {}
    for h in held:
        by_stream.setdefault(h.stream, []).append(h.entry_id)
    for stream, ids in by_stream.items():
        client.xclaim(stream, ROLLOUT_GROUP, consumer, 0, ids, justid=True)


def _ack_and_delete(pipe: redis.client.Pipeline, stream: str, *entry_ids: str) -> None:
    """Queue XACK + XDEL: an answered prompt leaves the stream (see the module docstring)."""
    pipe.xack(stream, ROLLOUT_GROUP, *entry_ids)
    pipe.xdel(stream, *entry_ids)


def acknowledge(client: redis.Redis, held: list[HeldPrompt]) -> None:
    """Acknowledge and delete prompts that need no answer (unparsable, or already answered)."""
    if not held:
        return
    with client.pipeline(transaction=True) as pipe:
        for h in held:
            _ack_and_delete(pipe, h.stream, h.entry_id)
        pipe.execute()


def reject(client: redis.Redis, keys: JobKeys, held: list[HeldPrompt]) -> None:
    """Answer prompts this worker cannot parse (say, from a trainer of another rljob version) with a
    rejection, instead of dropping them unseen while the trainer waits for their groups forever.

    The rejection goes where the group would (one transaction with the done set and the
    acknowledgement, as a group), so the trainer sees it, retries once, and then fails naming the
    cause. An entry without a request id (not even JSON) answers nobody: it is only acknowledged."""
    if not held:
        return
    done = DoneSet(client, keys)
    with client.pipeline(transaction=True) as pipe:
        for h in held:
            request_id = request_id_of(h.data)
            if request_id is not None:
                out = keys.eval_results if h.is_eval else keys.trajectories
                pipe.xadd(out, {REJECTED: request_id, REASON: h.error or "unparsable prompt"})
                done.mark(pipe, request_id)
            _ack_and_delete(pipe, h.stream, h.entry_id)
        pipe.execute()


def publish_group(client: redis.Redis, keys: JobKeys, prompt: HeldPrompt, group: TrajectoryGroup) -> bool:
    """Append the group and acknowledge its prompt atomically; False when it was already answered."""
    out = keys.eval_results if prompt.is_eval else keys.trajectories
    done = DoneSet(client, keys)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(done.key)
                already = bool(pipe.sismember(done.key, group.request_id))
                pipe.multi()
                if not already:
                    pipe.xadd(out, {DATA: group.model_dump_json()})
                    done.mark(pipe, group.request_id)
                _ack_and_delete(pipe, prompt.stream, prompt.entry_id)
                pipe.execute()
                return not already
            except redis.WatchError:
                continue  # another worker published meanwhile: look again


def release(client: redis.Redis, held: list[HeldPrompt]) -> None:
    """Hand prompts back at once (re-queue + ack in one transaction) instead of waiting for reclaim."""
    for h in held:
        with client.pipeline(transaction=True) as pipe:
            pipe.xadd(h.stream, {DATA: h.data})
            _ack_and_delete(pipe, h.stream, h.entry_id)
            pipe.execute()
