"""Run the operator from source as a child process (e2e tests, the benchmark, local clusters).

The chart is installed with `replicaCount=0`, and this process authenticates with the chart's
ServiceAccount token, so what it can do is exactly what the chart's RBAC grants.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rljob.ports import free_port


class OperatorProcess:
    """`python -m rljob_operator` with its own log file, metrics and liveness ports."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        *,
        namespace: str = "rljob-system",
        timer_interval: float = 1.0,
        restart_backoff: float = 1.0,
        extra_env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "RLJOB_OPERATOR_NAMESPACE": namespace,
            "RLJOB_TIMER_INTERVAL": str(timer_interval),
            "RLJOB_RESTART_BACKOFF_SECONDS": str(restart_backoff),
            "RLJOB_REDIS_TIMEOUT_SECONDS": "0.5",
            "RLJOB_METRICS_PORT": str(self.metrics_port),
            "RLJOB_LIVENESS": f"http://127.0.0.1:{self.liveness_port}/healthz",
            **(extra_env or {}),
        }
        self.args = list(args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> OperatorProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rljob_operator", *self.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.3)
        raise TimeoutError(f"operator not live after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Samples from /metrics, keyed by name{labels} (counters summed by the caller)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
