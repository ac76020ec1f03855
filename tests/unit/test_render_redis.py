"""The managed Redis command the operator renders, run for real: password required, never in argv,
memory cap applied."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from rljob.config import RLJob
from rljob.ports import free_port
from rljob_operator.render import RenderPlan, render_children


@pytest.mark.integration
def test_rendered_redis_command_runs_with_password_from_env(tmp_path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed")
    job = RLJob.model_validate(
        {
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {"weightSync": {"redis": {"memory": "64Mi", "persistence": True}}},
        }
    )
    sts = next(c for c in render_children(job, RenderPlan(uid="u", rollout_replicas=1)) if c["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    script = (
        container["command"][2].replace("--port 6379", f"--port {port}").replace("--dir /data", f"--dir {tmp_path}")
    )
    password = "only-in-the-environment-42"
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={**os.environ, "REDIS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert int(client.config_get("maxmemory")["maxmemory"]) == int(64 * 2**20 * 0.8)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert password not in argv
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
