"""What both ends of the queue read and write the same way: entry fields, consumer groups, rejections.

The workers' Redis client returns bytes (the weight store shares it and needs them), so text is
decoded here, in one place, rather than by a second client per process.
"""

from __future__ import annotations

import json
from typing import Any

import redis

DATA = "data"  # the JSON message of an entry
REJECTED, REASON = "rejected", "reason"  # a worker's answer to a prompt it cannot parse
SKEW_HINT = "the rollout workers most likely run an rljob image of a different version than the trainer"


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def entry_field(fields: dict[Any, Any] | None, name: str) -> Any:
    """An entry's field by name, whichever way the client returned the keys."""
    fields = fields or {}
    return fields.get(name.encode(), fields.get(name))


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create a consumer group reading from the start (and the stream), unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def rejection(fields: dict[Any, Any] | None) -> tuple[str, str] | None:
    """(request id, reason) of a worker's rejection of a prompt it could not parse, else None."""
    request_id = entry_field(fields, REJECTED)
    if request_id is None:
        return None
    return text(request_id), text(entry_field(fields, REASON) or b"")


def request_id_of(data: bytes | str | None) -> str | None:
    """The request id in a prompt's JSON, without validating the rest (a prompt this end cannot
    parse, or one it only needs the id of); None when there is none."""
    try:
        value = json.loads(data or b"")
    except ValueError:
        return None
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) and request_id else None
