"""Rank 0's Redis stream traffic: prompts out, trajectory groups in, eval round trips.

Trajectory groups are read with the trainer consumer group and acknowledged only after the step
that used them has been trained and published, so a trainer that dies mid-step finds them again
(its pending entries) when the gang restarts. Duplicates (a prompt redelivered to a second worker,
or re-enqueued after a restart) are recognised by request id and acknowledged unused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from rljob.keys import TRAINER_GROUP, JobKeys
from rljob.protocol import PromptRequest, TrajectoryGroup

log = logging.getLogger(__name__)


def _s(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def enqueue_prompts(client: redis.Redis, stream: str, requests: Sequence[PromptRequest]) -> None:
    pipe = client.pipeline(transaction=False)
    for req in requests:
        pipe.xadd(stream, {"data": req.model_dump_json()})
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
    expected: dict[str, int] = field(default_factory=dict)  # request id -> step
    buffer: dict[str, _Pending] = field(default_factory=dict)  # request id -> first copy received
    _backlog_cursor: str | None = "0"  # None once our pending entries have all been read back

    def __post_init__(self) -> None:
        ensure_group(self.client, self.keys.trajectories, TRAINER_GROUP)

    def expect(self, requests: Sequence[PromptRequest]) -> None:
        for req in requests:
            self.expected[req.request_id] = req.step

    def _read(self) -> list[tuple[str, dict]]:
        # First our own pending entries (delivered before a restart, never acknowledged), then new ones.
        backlog = self._backlog_cursor is not None
        start = self._backlog_cursor if backlog else ">"
        reply = self.client.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.trajectories: start}, count=256,
            block=None if backlog else self.block_ms,
        )  # fmt: skip
        entries = reply[0][1] if reply else []
        if backlog:
            self._backlog_cursor = _s(entries[-1][0]) if entries else None
        return [(_s(eid), fields) for eid, fields in entries]

    def _accept(self, entry_id: str, fields: dict, current_step: int) -> None:
        raw = fields.get(b"data", fields.get("data"))
        try:
            group = TrajectoryGroup.model_validate_json(raw)
        except Exception as exc:  # a malformed entry must not wedge the trainer
            log.warning("dropping malformed trajectory entry %s: %s", entry_id, exc)
            self.ack([entry_id])
            return
        step = self.expected.get(group.request_id)
        if step is None or step < current_step or group.request_id in self.buffer:
            self.ack([entry_id])  # unknown, late or duplicate
            return
        self.buffer[group.request_id] = _Pending(entry_id, group)

    def collect(
        self,
        step: int,
        request_ids: Sequence[str],
        *,
        timeout_s: float | None = None,
        on_wait: Callable[[int, int], None] | None = None,
    ) -> tuple[list[TrajectoryGroup], list[str]]:
        """Block until every request of `step` has a group; returns them in request order, plus
        the stream entry ids to acknowledge once the step is published."""
        started = last_report = time.monotonic()
        wanted = list(request_ids)
        while True:
            missing = [r for r in wanted if r not in self.buffer]
            if not missing:
                break
            if time.monotonic() - last_report >= 15:
                last_report = time.monotonic()
                log.info("step %d: %d/%d trajectory groups in (%.0fs)", step, len(wanted) - len(missing),
                         len(wanted), last_report - started)  # fmt: skip
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"step {step}: {len(missing)} of {len(wanted)} trajectory groups missing")
            for entry_id, fields in self._read():
                self._accept(entry_id, fields, step)
            if on_wait is not None:
                on_wait(len(wanted) - len(missing), len(wanted))
        pending = [self.buffer.pop(r) for r in wanted]
        for r in wanted:
            self.expected.pop(r, None)
        return [p.group for p in pending], [p.entry_id for p in pending]

    def ack(self, entry_ids: Sequence[str]) -> None:
        if entry_ids:
            self.client.xack(self.keys.trajectories, TRAINER_GROUP, *entry_ids)


def stream_last_id(client: redis.Redis, stream: str) -> str:
    newest = client.xrevrange(stream, "+", "-", count=1)
    return _s(newest[0][0]) if newest else "0-0"


def eval_round(
    client: redis.Redis,
    keys: JobKeys,
    requests: Sequence[PromptRequest],
    *,
    timeout_s: float,
    block_ms: int = 1000,
) -> list[TrajectoryGroup]:
    """Enqueue greedy eval prompts and wait for their results (any order, duplicates ignored)."""
    since = stream_last_id(client, keys.eval_results)
    enqueue_prompts(client, keys.eval_prompts, requests)
    wanted = {r.request_id for r in requests}
    got: dict[str, TrajectoryGroup] = {}
    deadline = time.monotonic() + timeout_s
    started = last_report = time.monotonic()
    while len(got) < len(wanted):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"eval: {len(wanted) - len(got)} of {len(wanted)} results missing")
        if now - last_report >= 15:
            last_report = now
            log.info("eval: %d/%d questions answered (%.0fs)", len(got), len(wanted), now - started)
        reply = client.xread({keys.eval_results: since}, count=256, block=block_ms)
        for _, entries in reply or []:
            for eid, fields in entries:
                since = _s(eid)
                raw: Any = fields.get(b"data", fields.get("data"))
                try:
                    group = TrajectoryGroup.model_validate_json(raw)
                except Exception:
                    continue
                if group.request_id in wanted:
                    got.setdefault(group.request_id, group)
    return [got[r.request_id] for r in requests]
