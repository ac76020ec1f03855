"""The embedded redis-server that local runs and the fixtures use: one process per object."""

from __future__ import annotations

import pytest
import redis

from rljob.embedded_redis import EmbeddedRedis

pytestmark = pytest.mark.integration


def test_start_is_idempotent_and_the_context_manager_stops_the_one_process(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path / "r").start()
    first = server.process
    assert first is not None
    with server.start() as same:  # `with EmbeddedRedis().start()` must not spawn a second server
        assert same.process is first
        assert redis.Redis.from_url(same.url).ping()
    assert server.process is None
    assert first.poll() is not None, "the server started first must be stopped on exit"


def test_restart_keeps_the_url_and_aof_keeps_the_data(tmp_path) -> None:
    with EmbeddedRedis(tmp_path / "r", appendonly=True) as server:
        url = server.url
        redis.Redis.from_url(url).set("k", b"v")
        server.restart()
        assert server.url == url
        assert redis.Redis.from_url(url).get("k") == b"v"
