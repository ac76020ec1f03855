"""Fixtures shared by every test tier: a real redis-server for integration tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rljob.embedded_redis import EmbeddedRedis, RedisNotInstalled

REPO = Path(__file__).resolve().parent
# pyproject's `pythonpath` puts this checkout's packages first for pytest itself; the processes
# tests start (the operator, `python -m rljob`, workers) get them through PYTHONPATH, so they too
# run this checkout's code, not what the shared venv's editable install points at. tests/ itself
# is there for `support`, the test scaffolding (toy environments, tiny models) kept out of the wheel.
_OWN_PATHS = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    _OWN_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _OWN_PATHS]
)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[EmbeddedRedis]:
    """A fresh redis-server with AOF on a free loopback port, stopped after the test."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True)
    try:
        server.start()
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))  # a missing server is a broken setup, not a reason to skip
    yield server
    server.close()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core runner they oversubscribe."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _process_ended(pid: int) -> bool:
    """Gone, or a zombie waiting for a reaper (in a container, PID 1 may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def process_ended() -> Callable[[int], bool]:
    """Whether a process (not necessarily our child) has ended: Linux's /proc."""
    return _process_ended
