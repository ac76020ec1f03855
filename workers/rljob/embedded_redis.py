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

INSTALL_HINT = "install it with: apt-get install -y redis-server (Debian/Ubuntu) or brew install redis"


class RedisNotInstalled(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="rljob-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.password = password
        self.port = port or free_port()
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
        args = [
            find_redis_server(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always" if self.appendonly else "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{tail}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    sock.recv(64)
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

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
