"""The password goes into the Redis URL without losing the ACL user, an IPv6 host, the db or the scheme."""

from __future__ import annotations

import pytest
from redis.connection import parse_url

from rljob.runtime_env import WorkerEnv, with_password

PASSWORD = "p@ss:w/rd %?#"  # every character that would break a URL unencoded


def _env(url: str, password: str | None = PASSWORD) -> WorkerEnv:
    return WorkerEnv(config_path="job.yaml", redis_url=url, redis_password=password, worker_id="w")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "rediss://rljob@redis.example.com:6380/0",
            {"username": "rljob", "host": "redis.example.com", "port": 6380, "db": 0, "ssl": True},
        ),
        ("redis://[fd00::1]:6379/0", {"username": None, "host": "fd00::1", "port": 6379, "db": 0}),
        ("redis://rljob@[fd00::1]/4", {"username": "rljob", "host": "fd00::1", "db": 4}),
        ("redis://Redis.Example:6379/2", {"host": "redis.example", "port": 6379, "db": 2}),
        ("redis://old:stale@host:7000/1", {"username": "old", "host": "host", "port": 7000, "db": 1}),
    ],
)
def test_authenticated_url_keeps_user_host_db_and_scheme(url: str, expected: dict) -> None:
    kwargs = parse_url(_env(url).authenticated_redis_url)
    assert kwargs["password"] == PASSWORD
    for key, value in expected.items():
        if key == "ssl":
            assert kwargs.get("connection_class").__name__ == "SSLConnection"
        else:
            assert kwargs.get(key) == value, key


def test_query_and_scheme_survive_verbatim() -> None:
    url = with_password("rediss://rljob@Redis.Example:6380/2?ssl_cert_reqs=none", "pw")
    assert url == "rediss://rljob:pw@Redis.Example:6380/2?ssl_cert_reqs=none"


def test_no_password_leaves_the_url_alone() -> None:
    assert _env("redis://rljob@[fd00::1]:6379/0", None).authenticated_redis_url == "redis://rljob@[fd00::1]:6379/0"


@pytest.mark.integration
def test_a_named_acl_user_authenticates_as_itself(redis_server, redis_client) -> None:
    """Against a real redis-server whose default user is off: only the named user can log in."""
    import redis

    redis_client.execute_command("ACL", "SETUSER", "rljob", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    redis_client.execute_command("ACL", "SETUSER", "default", "off")
    env = _env(f"redis://rljob@127.0.0.1:{redis_server.port}/3")
    client = redis.Redis.from_url(env.authenticated_redis_url)
    try:
        assert client.acl_whoami() == "rljob"
        client.set("k", "v")
        assert client.connection_pool.connection_kwargs["db"] == 3
        assert client.execute_command("CLIENT", "INFO").decode().count(" db=3 ") == 1
    finally:
        client.close()
