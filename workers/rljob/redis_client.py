"""The workers' Redis client: one that rides out a restart of the job's Redis.

The job's Redis is a single pod; it restarts when its node drains, when it is OOM-killed, or when
its spec changes. redis-py's default retry (three tries within milliseconds) would fail the next
command of every worker, and a trainer failure costs the gang a restart of its `restartLimit`; so
a command is retried on connection errors with exponential backoff for about a minute (what Redis
held survives with AOF, the default).

A command whose reply was lost may run twice. The writes here tolerate that: a transaction under
WATCH is not re-run (redis-py raises WatchError, and the stream code looks again); the others are
idempotent (acknowledgements, set removals), deduplicated downstream by request id (a prompt
enqueued twice), or recognised (a weight commit that already landed: `WeightPublisher`).
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# Backoff 0.1, 0.2, 0.4, 0.8, 1.6, then 2 s per try: about 63 s of waiting over 35 tries.
_BACKOFF = ExponentialBackoff(cap=2.0, base=0.05)
_RETRIES = 35
# A connect to a pod that is gone (its address not yet reassigned) must not hang for minutes.
_CONNECT_TIMEOUT_S = 5.0


def connect(url: str) -> redis.Redis:
    """A client for `url` whose commands wait out a Redis restart of up to about a minute."""
    return redis.Redis.from_url(
        url,
        retry=Retry(_BACKOFF, _RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
    )


def outage_budget_s() -> float:
    """How long a command keeps retrying before it fails (the sum of the backoffs)."""
    return sum(_BACKOFF.compute(failures) for failures in range(1, _RETRIES + 1))
