"""The done set: request ids whose group is published, so a redelivered prompt is answered once.

Its lifecycle in one place. A worker adds an id in the transaction that publishes the group (or
a rejection) and acknowledges the prompt (`mark`). The trainer takes ids out once it no longer
waits for them: trained steps, read evaluation rounds, a request it re-enqueues (`forget`), and
evaluation ids an earlier round left behind (`forget_earlier_evals`). So the set holds only
requests in flight instead of one id per group forever. A late duplicate of a forgotten request
(a reclaimed prompt a second worker still held) is generated once more and dropped as late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis

from rljob.keys import JobKeys
from rljob.protocol import EVAL_ID_PREFIX
from rljob.queue.wire import text


@dataclass(frozen=True)
class DoneSet:
    client: redis.Redis
    keys: JobKeys

    @property
    def key(self) -> str:
        return self.keys.rollout_done

    def answered(self, request_ids: Sequence[str]) -> set[str]:
        """Those of `request_ids` whose group (or rejection) is published."""
        if not request_ids:
            return set()
        flags = self.client.smismember(self.key, list(request_ids))
        return {rid for rid, flag in zip(request_ids, flags, strict=True) if flag}

    def mark(self, pipe: redis.client.Pipeline, request_id: str) -> None:
        """Queue the mark into the transaction that publishes the answer."""
        pipe.sadd(self.key, request_id)

    def forget(self, request_ids: Sequence[str], pipe: redis.client.Pipeline | None = None) -> None:
        """Take ids out (in `pipe`'s transaction when given)."""
        if request_ids:
            (pipe or self.client).srem(self.key, *request_ids)

    def forget_earlier_evals(self) -> None:
        """Evaluation ids of earlier rounds: a round that timed out took out its own, but its
        prompts answered later put them back, and nothing else would remove them."""
        stale = list(self.client.sscan_iter(self.key, match=f"{EVAL_ID_PREFIX}*", count=1000))
        self.forget([text(member) for member in stale])
