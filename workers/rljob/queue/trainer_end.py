"""The trainer's end of the queue (rank 0): prompts out, trajectory groups in, eval round trips.

Trajectory groups are read with the trainer consumer group and acknowledged only after the step
that used them has been trained and published, so a trainer that dies mid-step finds them again
(its pending entries) when the gang restarts. Duplicates (a prompt redelivered to a second worker,
or re-enqueued after a restart) are recognised by request id and acknowledged unused.

Retention (see `rljob.queue`): every trajectory entry is deleted in the transaction that
acknowledges it, and eval results are deleted once read (the trainer is their only reader).

A Redis that restarts can also leave a step waiting for what it no longer has, both checked by a
wait that makes no progress for `lost_check_s`:
- a delivery whose reply was lost: Redis logs an XREADGROUP to its append-only file before it
  answers, so one killed in between comes back with the group pending for this consumer, and '>'
  never returns it again. The wait reads back what its own pending list holds beyond its buffer.
- a prompt that vanished: with `appendfsync everysec` (the cluster's Redis) a crash loses up to the
  last second of writes, our XADD of the prompts among them. A request whose prompt is not in the
  prompt stream and whose id is not in the done set (read in one transaction: a prompt leaves the
  stream in the transaction that marks it done) is enqueued again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from rljob.keys import TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup
from rljob.queue.done import DoneSet
from rljob.queue.wire import DATA, SKEW_HINT, ensure_group, entry_field, rejection, request_id_of, text

log = logging.getLogger(__name__)


class IncompatibleGroupError(RuntimeError):
    """A worker's answers cannot be parsed by this trainer, even after a retry."""


def requeue_vanished(client: redis.Redis, keys: JobKeys, stream: str, waiting: Mapping[str, PromptRequest]) -> None:
    """Enqueue again those of the `waiting` prompts (request id -> prompt) neither queued on `stream`
    nor answered: Redis lost them with its last writes. Read in one transaction, as a prompt leaves
    the stream in the transaction that marks its id done."""
    if not waiting:
        return
    request_ids = list(waiting)
    with client.pipeline(transaction=True) as pipe:
        pipe.xrange(stream)
        pipe.smismember(keys.rollout_done, request_ids)
        queued, answered = pipe.execute()
    queued_ids = {request_id_of(entry_field(fields, DATA)) for _, fields in queued}
    vanished = [r for r, done in zip(request_ids, answered, strict=True) if not done and r not in queued_ids]
    if vanished:
        log.warning("%s: enqueuing %d prompts again: Redis lost them with its last writes", stream, len(vanished))
        enqueue_prompts(client, stream, [waiting[r] for r in vanished])


def enqueue_prompts(client: redis.Redis, stream: str, requests: Sequence[PromptRequest]) -> None:
    pipe = client.pipeline(transaction=False)
    for req in requests:
        pipe.xadd(stream, {DATA: req.model_dump_json()})
    pipe.execute()


@dataclass
class _Pending:
    entry_id: str
    group: TrajectoryGroup


@dataclass
class TrajectoryCollector:
    """Buffers groups by step until a step has every group it asked for."""

    client: redis.Redis
    keys: JobKeys
    consumer: str = "trainer-0"
    block_ms: int = 1000
    max_requeues: int = 1  # per request: one retry tells a one-off from a systematic failure
    lost_check_s: float = 10.0  # a wait this long without a new group looks for what a restart lost
    expected: dict[str, PromptRequest] = field(default_factory=dict)  # request id -> its prompt
    buffer: dict[str, _Pending] = field(default_factory=dict)  # request id -> first copy received
    requeued: dict[str, int] = field(default_factory=dict)  # request id -> times re-enqueued
    _backlog_cursor: str | None = "0"  # None once our pending entries have all been read back
    _dropped: str | None = None  # why the last unparsable entry was dropped, until we looked for losses
    done: DoneSet = field(init=False)

    def __post_init__(self) -> None:
        ensure_group(self.client, self.keys.trajectories, TRAINER_GROUP)
        self.done = DoneSet(self.client, self.keys)

    def expect(self, requests: Sequence[PromptRequest]) -> None:
        for req in requests:
            self.expected[req.request_id] = req

    def _read(self, block_ms: int | None) -> list[tuple[str, dict | None]]:
        # First our own pending entries (delivered before a restart, never acknowledged), then new ones.
        backlog = self._backlog_cursor is not None
        start = self._backlog_cursor if backlog else ">"
        reply = self.client.xreadgroup(
            TRAINER_GROUP,
            self.consumer,
            {self.keys.trajectories: start},
            count=256,
            block=None if backlog else block_ms,
        )
        entries = reply[0][1] if reply else []
        if backlog:
            self._backlog_cursor = text(entries[-1][0]) if entries else None
        return [(text(eid), fields) for eid, fields in entries]

    def _accept(self, entry_id: str, fields: dict | None, current_step: int) -> None:
        rejected = rejection(fields)
        if rejected is not None:  # a worker could not parse our prompt: handled as an unparsable group
            log.warning("a rollout worker rejected the prompt of request %s: %s", *rejected)
            self._dropped = f"a rollout worker could not parse its prompt: {rejected[1]}"
            self.ack([entry_id])
            return
        try:
            group = TrajectoryGroup.model_validate_json(entry_field(fields, DATA))
        except Exception as exc:  # a malformed entry must not wedge the trainer
            log.warning("dropping malformed trajectory entry %s: %s", entry_id, exc)
            self._dropped = f"{type(exc).__name__}: {exc}"[:500]
            self.ack([entry_id])
            return
        held = self.buffer.get(group.request_id)
        if held is not None:
            if held.entry_id != entry_id:  # else: the very entry we hold, read back from our pending list
                self.ack([entry_id])  # a duplicate of a request in flight, whose id stays done
            return
        req = self.expected.get(group.request_id)
        if req is None or req.step < current_step:
            # Unknown (an earlier run's, or a step already trained) or late: its publish put the id
            # back into the done set, where nothing would ever take it out again.
            self.ack([entry_id], done=[group.request_id])
            return
        self.buffer[group.request_id] = _Pending(entry_id, group)

    def _drain(self, current_step: int) -> None:
        """Accept everything in the stream now, without waiting."""
        while True:
            entries = self._read(None)
            for entry_id, fields in entries:
                self._accept(entry_id, fields, current_step)
            if not entries and self._backlog_cursor is None:
                return

    def _recover_lost(self, current_step: int, missing: Sequence[str]) -> None:
        """Read back lost deliveries, then enqueue again the prompts of `missing` that vanished
        (see the module docstring)."""
        buffered = {p.entry_id for p in self.buffer.values()}
        stream = self.keys.trajectories
        pending = self.client.xpending_range(
            stream, TRAINER_GROUP, "-", "+", count=len(buffered) + 256, consumername=self.consumer
        )
        lost = [entry_id for p in pending if (entry_id := text(p["message_id"])) not in buffered]
        if lost:
            log.warning("reading back %d trajectory groups whose delivery was lost (Redis restarted?)", len(lost))
        for entry_id in lost:
            rows = self.client.xrange(stream, entry_id, entry_id)
            if rows:
                self._accept(entry_id, rows[0][1], current_step)
            else:
                self.ack([entry_id])  # deleted meanwhile: only its pending record is left
        waiting = {r: self.expected[r] for r in missing if r not in self.buffer and r in self.expected}
        requeue_vanished(self.client, self.keys, self.keys.prompts, waiting)

    def _recover_dropped(self, current_step: int) -> None:
        """Re-enqueue requests a worker answered whose group we dropped as unparsable: their ids are
        done, so nobody else would regenerate them. After `max_requeues`, `IncompatibleGroupError`.

        The done set is read before draining the stream: a worker adds the id and its group in one
        transaction, so an id that was done then and still has no group after the drain was dropped."""
        reason, self._dropped = self._dropped, None
        answered = self.done.answered([r for r in self.expected if r not in self.buffer])
        self._drain(current_step)
        for request_id in answered:
            if request_id not in self.buffer:
                self._requeue(request_id, reason or "unparsable")

    def _requeue(self, request_id: str, reason: str) -> None:
        tries = self.requeued[request_id] = self.requeued.get(request_id, 0) + 1
        if tries > self.max_requeues:
            raise IncompatibleGroupError(
                f"the trajectory group for request {request_id} could not be parsed {tries} times ({reason}); "
                f"{SKEW_HINT}"
            )
        log.warning("re-enqueuing request %s: its trajectory group could not be parsed (%s)", request_id, reason)
        with self.client.pipeline(transaction=True) as pipe:  # a worker must not see the prompt while still done
            self.done.forget([request_id], pipe)
            pipe.xadd(self.keys.prompts, {DATA: self.expected[request_id].model_dump_json()})
            pipe.execute()

    def collect(
        self,
        step: int,
        request_ids: Sequence[str],
        *,
        timeout_s: float | None = None,
        on_wait: Callable[[], object] | None = None,
    ) -> tuple[list[TrajectoryGroup], list[str]]:
        """Block until every request of `step` has a group; returns them in request order, plus
        the stream entry ids to acknowledge once the step is published."""
        started = last_report = last_progress = time.monotonic()
        wanted = list(request_ids)
        arrived = -1
        while True:
            if self._dropped is not None:
                self._recover_dropped(step)
            missing = [r for r in wanted if r not in self.buffer]
            if not missing:
                break
            if len(wanted) - len(missing) != arrived:
                arrived, last_progress = len(wanted) - len(missing), time.monotonic()
            elif time.monotonic() - last_progress >= self.lost_check_s:
                last_progress = time.monotonic()
                self._recover_lost(step, missing)
                continue
            if time.monotonic() - last_report >= 15:
                last_report = time.monotonic()
                waited = last_report - started
                log.info("step %d: %d/%d trajectory groups in (%.0fs)", step, arrived, len(wanted), waited)
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"step {step}: {len(missing)} of {len(wanted)} trajectory groups missing")
            for entry_id, fields in self._read(self.block_ms):
                self._accept(entry_id, fields, step)
            if on_wait is not None:
                on_wait()
        pending = [self.buffer.pop(r) for r in wanted]
        for r in wanted:
            self.expected.pop(r, None)
            self.requeued.pop(r, None)
        return [p.group for p in pending], [p.entry_id for p in pending]

    def ack(self, entry_ids: Sequence[str], done: Sequence[str] = ()) -> None:
        """Acknowledge and delete, in one transaction: acknowledged entries must not pile up.

        `done`: request ids of a step now trained, taken out of the done set in the same transaction
        (see `rljob.queue.done`)."""
        if not entry_ids and not done:
            return
        with self.client.pipeline(transaction=True) as pipe:
            if entry_ids:
                pipe.xack(self.keys.trajectories, TRAINER_GROUP, *entry_ids)
                pipe.xdel(self.keys.trajectories, *entry_ids)
            self.done.forget(done, pipe)
            pipe.execute()


def clear_earlier_runs(client: redis.Redis, keys: JobKeys) -> int:
    """Delete the prompts an earlier run of the trainer left queued; returns how many.

    A restarted gang asks for its steps under new request ids (the run tag), and drops groups
    answering the old ones unused: they were sampled with weights the resumed run does not have.
    Left queued, the old prompts were generated anyway, evaluation ones first, ahead of the new
    run's. A worker still holding one finishes it harmlessly (its group is dropped as unknown)."""
    with client.pipeline(transaction=True) as pipe:
        for stream in (keys.prompts, keys.eval_prompts):
            pipe.xlen(stream)
            pipe.xtrim(stream, maxlen=0, approximate=False)
        replies = pipe.execute()
    dropped = int(replies[0]) + int(replies[2])
    if dropped:
        log.warning("dropped %d prompts an earlier run of the trainer left queued", dropped)
    return dropped


def eval_round(
    client: redis.Redis,
    keys: JobKeys,
    requests: Sequence[PromptRequest],
    *,
    timeout_s: float,
    block_ms: int = 1000,
    on_wait: Callable[[], object] | None = None,
    lost_check_s: float = 10.0,
) -> list[TrajectoryGroup]:
    """Enqueue greedy eval prompts and wait for their results (any order, duplicates ignored);
    `on_wait` runs once per wait (the trainer answers weight-rebase requests there).

    Results are deleted as they are read, and those left by an earlier round that timed out are
    trimmed first. An unparsable result fails at once: waiting out the timeout would not help.
    A wait without a new result for `lost_check_s` enqueues again the prompts Redis lost."""
    newest = client.xrevrange(keys.eval_results, "+", "-", count=1)
    since = text(newest[0][0]) if newest else "0-0"
    client.xtrim(keys.eval_results, maxlen=0, approximate=False)  # older rounds' leftovers: nobody reads them
    done = DoneSet(client, keys)
    done.forget_earlier_evals()
    enqueue_prompts(client, keys.eval_prompts, requests)
    by_id = {r.request_id: r for r in requests}
    got: dict[str, TrajectoryGroup] = {}
    deadline = time.monotonic() + timeout_s
    started = last_report = last_progress = time.monotonic()
    while len(got) < len(by_id):
        now = time.monotonic()
        if now - last_progress >= lost_check_s:
            last_progress = now
            requeue_vanished(client, keys, keys.eval_prompts, {r: q for r, q in by_id.items() if r not in got})
        if now > deadline:
            done.forget(list(by_id))  # whatever answers come later is trimmed unread
            raise TimeoutError(f"eval: {len(by_id) - len(got)} of {len(by_id)} results missing")
        if now - last_report >= 15:
            last_report = now
            log.info("eval: %d/%d questions answered (%.0fs)", len(got), len(by_id), now - started)
        reply = client.xread({keys.eval_results: since}, count=256, block=block_ms)
        if on_wait is not None:
            on_wait()
        entries = [(text(eid), fields) for _, batch in reply or [] for eid, fields in batch]
        if entries:
            since = entries[-1][0]
            client.xdel(keys.eval_results, *[eid for eid, _ in entries])
        for eid, fields in entries:
            group = _eval_result(eid, fields)
            if group.request_id in by_id and group.request_id not in got:
                got[group.request_id] = group
                last_progress = time.monotonic()
    done.forget(list(by_id))  # answered and read: the done set keeps only what is in flight
    return [got[r.request_id] for r in requests]


def _eval_result(entry_id: str, fields: dict) -> TrajectoryGroup:
    rejected = rejection(fields)
    if rejected is not None:
        raise IncompatibleGroupError(
            f"a rollout worker could not parse eval prompt {rejected[0]} ({rejected[1]}); {SKEW_HINT}"
        )
    try:
        return TrajectoryGroup.model_validate_json(entry_field(fields, DATA))
    except Exception as exc:
        raise IncompatibleGroupError(f"eval result {entry_id} could not be parsed ({exc}); {SKEW_HINT}") from exc
