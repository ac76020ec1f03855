"""The embedded redis-server that local runs and the fixtures use: one process per object."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from rljob import parent_death
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


def _listening_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(tmp_path) -> None:
    """free_port() picks a port and lets it go; another process may take it before redis-server
    binds it (parallel tests, a busy CI machine). That start failed; now another port is picked."""
    server = EmbeddedRedis(tmp_path / "r")
    taken = server.port
    with _listening_socket(taken), server.start():
        assert server.port != taken
        assert redis.Redis.from_url(server.url).ping()


def test_a_restart_keeps_its_port_or_fails(tmp_path) -> None:
    """Clients hold the url: a restart whose port was taken meanwhile fails instead of moving."""
    with EmbeddedRedis(tmp_path / "r") as server:
        port = server.port
        server.kill()
        with _listening_socket(port), pytest.raises(RuntimeError, match=f"port {port} is taken"):
            server.start()
        assert server.restart().port == port


def test_a_port_given_and_taken_is_an_error_not_another_servers_answer(tmp_path) -> None:
    """A port the caller chose is not replaced; and a server already answering on it is not taken
    for ours (the start checked PONG from whoever answered, so it could report a dead server up)."""
    with EmbeddedRedis(tmp_path / "a") as other:
        with pytest.raises(RuntimeError, match=f"port {other.port} is taken"):
            EmbeddedRedis(tmp_path / "b", port=other.port).start()
        assert redis.Redis.from_url(other.url).ping()


PARENT = """
import signal, subprocess, sys, time
from rljob.embedded_redis import EmbeddedRedis
from rljob.parent_death import guarded
server = EmbeddedRedis(sys.argv[1], die_with_parent=True).start()
child = subprocess.Popen(guarded(["sleep", "600"], signal.SIGKILL), start_new_session=True)
print(server.process.pid, child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not parent_death.SUPPORTED, reason="PR_SET_PDEATHSIG is Linux's")
def test_children_started_guarded_end_when_their_parent_is_killed_outright(tmp_path, process_ended) -> None:
    """A SIGKILLed parent runs no shutdown: its guarded redis-server and its other guarded child
    (each in a session of its own, as `rljob run --local` starts them) end with it all the same."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "r")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and not any(process_ended(pid) for pid in pids)
        assert Path(f"/proc/{pids[0]}/comm").read_text().strip() == "redis-server"  # the guard exec'd it
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not all(process_ended(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(process_ended(pid) for pid in pids), "children outlived their SIGKILLed parent"


def test_the_guard_refuses_to_run_a_command_whose_parent_is_already_gone() -> None:
    """The parent may die before the guard has asked for the signal: then no signal would ever
    come, so the command must not start."""
    command = parent_death.guarded(["true"], signal.SIGKILL)
    command[3] = "1"  # a parent pid that is not the guard's parent
    done = subprocess.run(command, capture_output=True)
    assert done.returncode == 128 + signal.SIGKILL
