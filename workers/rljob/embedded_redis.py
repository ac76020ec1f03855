"""A real `redis-server` on a free loopback port, owned by this process.

Used by `rljob run --local` and by the integration-test fixtures. Persistence (AOF) is optional so
tests can kill and restart the server and find their data again.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rljob.parent_death import guarded
from rljob.ports import free_port

INSTALL_HINT = "install it with: apt-get install -y redis-server (Debian/Ubuntu) or brew install redis"


class RedisNotInstalled(RuntimeError):
    pass


class _PortTaken(RuntimeError):
    pass


# Ports tried by a server whose port was picked for it, before its start fails.
_PORT_ATTEMPTS = 5


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RedisNotInstalled(f"redis-server was not found on PATH; {INSTALL_HINT}")
    return path


class EmbeddedRedis:
    """Start, kill, restart and stop one redis-server; `url` stays the same across restarts."""

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        appendonly: bool = False,
        password: str | None = None,
        port: int | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: the server gets SIGTERM when the thread that starts it ends, even by
        SIGKILL (Linux; see rljob.parent_death). Without a `port`, a free one is picked, and
        another if that one is taken by the time the server first binds it (the pick can race);
        a restart keeps the port, or fails."""
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="rljob-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.password = password
        self._pick_port = port is None
        self.port = port or free_port()
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server; a no-op while it runs (``with EmbeddedRedis().start()`` would
        otherwise leave the first process running, unowned)."""
        if self.process is not None and self.process.poll() is None:
            return self
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._start_once(timeout)
                self._pick_port = False  # from now on the url is handed out: restarts keep the port
                return self
            except _PortTaken:
                if not self._pick_port or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port()  # someone took the picked port in between: pick again
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> EmbeddedRedis:
        args = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.workdir)]
        args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        args += ["--appendfsync", "always" if self.appendonly else "no", "--protected-mode", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.die_with_parent:
            args = guarded(args, signal.SIGTERM)
        log_path = self.workdir / "redis.log"
        logged_before = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                with open(log_path, "rb") as f:
                    f.seek(logged_before)
                    tail = f.read().decode(errors="replace")[-2000:]
                if "Address already in use" in tail:
                    raise _PortTaken(f"port {self.port} is taken")
                raise RuntimeError(f"redis-server exited with {code}:\n{tail}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        """Whether our server answers on the port: the answering process must be ours (a server
        that lost the port to another one would otherwise pass for up until it exits)."""
        assert self.process is not None
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    sock.recv(64)
                sock.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n\r\n"):
                    data = sock.recv(4096)
                    if not data:
                        return False
                    reply += data
        except OSError:
            return False
        pid = reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
        return pid.strip() == str(self.process.pid).encode()

    def running(self) -> bool:
        """Whether the server started here is still alive (it may have crashed or been killed)."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed beyond what AOF already has."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> EmbeddedRedis:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
