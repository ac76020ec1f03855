"""The operator's manifests run for real: trainer, rollout workers and the job's Redis as host
processes on e2e/hostlet's node, through the real control plane, with SmolLM2-135M on CPU.

Each namespace here is annotated so its pods land on the hostlet's node (PodNodeSelector and
PodTolerationRestriction, as a cluster admin would pin a team to a node pool); the operator runs
under the chart's ServiceAccount, with *.svc names resolved to loopback (e2e/hostlet/resolver).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from localcluster import wait_for
from ops import Ops, operator_session
from rljob.assets import smollm2_model_dir
from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.protocol import TrainerMetrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

HOSTLET = Path(__file__).resolve().parent / "hostlet"
NODE = "hostlet"
PLACEMENT = {
    "scheduler.alpha.kubernetes.io/node-selector": "rljob.dev/host-process=true",
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps(
        [{"key": "rljob.dev/host-process", "operator": "Exists", "effect": "NoSchedule"}]
    ),
}


class HostletProcess:
    """The hostlet as a child process, and where it keeps each pod (logs, pid, volumes)."""

    def __init__(self, cluster, root: Path) -> None:
        self.root = root
        path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
        # The host plays the worker image, which carries the bundled model already converted
        # (docker/workers.Dockerfile): the host's cache, converted here once, stands for it.
        image_cache = smollm2_model_dir().parents[1]
        args = ["--kubeconfig", str(cluster.kubeconfig), "--root", str(root), "--node", NODE, "--path", path]
        self.log = root / "hostlet.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(HOSTLET / "hostlet.py"), *args, "--env", f"RLJOB_CACHE={image_cache}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pod_dir(self, ns: str, pod: str) -> Path:
        (found,) = (self.root / "pods" / ns).glob(f"{pod}-*")
        return found

    def pid(self, ns: str, pod: str) -> int:
        return int((self.pod_dir(ns, pod) / "container.pid").read_text())

    def container_log(self, ns: str, pod: str) -> str:
        return (self.pod_dir(ns, pod) / "container.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def hostlet(cluster, tmp_path_factory) -> Iterator[HostletProcess]:
    process = HostletProcess(cluster, tmp_path_factory.mktemp("hostlet"))
    try:
        wait_for(
            lambda: (
                cluster.kubectl(
                    "get", "node", NODE, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
                ).stdout
                == "True"
            ),
            timeout=60,
            what="the hostlet's node Ready",
        )
        yield process
    finally:
        process.stop()
        print(process.log.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def ops(cluster, hostlet, tmp_path_factory) -> Iterator[Ops]:
    resolver = str(HOSTLET / "resolver")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (resolver, os.environ.get("PYTHONPATH")) if p)}
    with operator_session(cluster, tmp_path_factory.mktemp("operator") / "operator.log", env) as ops:
        yield ops


@pytest.fixture
def ns(cluster) -> Iterator[str]:
    name = f"real-{uuid.uuid4().hex[:6]}"
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "annotations": PLACEMENT}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    # Pods here share the host's ports (Redis 6379, the rendezvous 29500): the next test's job
    # may start only once this one's processes are gone.
    wait_for(
        lambda: not cluster.kubectl("get", "pods", "-n", name, "-o", "name", check=False).stdout.strip(),
        timeout=120,
        what=f"the pods of {name} gone",
    )


def real_job(name: str, steps: int, **spec: Any) -> dict[str, Any]:
    """A job small enough for two cores: the bundled SmolLM2-135M, 2 questions x 4 samples a step.
    No evaluation unless a test asks for one: each is a greedy round before the first step and
    after the last, seconds of two cores that only the tests reading its results should spend."""
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "bundled:smollm2-135m-instruct"},
            "data": {"trainPath": "bundled:train.jsonl", "evalPath": "bundled:dev.jsonl", "maxTrainQuestions": 64},
            "agent": {
                "maxTurns": 2,
                "maxNewTokensPerTurn": 32,
                "maxTotalTokens": 512,
                "topK": 2,
                "passageMaxWords": 30,
                "formatReward": 0.2,
                "searchReward": 0.1,
            },
            "grpo": {
                "groupSize": 4,
                "questionsPerStep": 2,
                "microBatchSize": 4,
                "totalSteps": steps,
                "checkpointInterval": 2,
                "learningRate": 1.0e-5,
            },
            "rollout": {
                "engine": "hf",
                "minReplicas": 1,
                "maxReplicas": 1,
                "batchSize": 8,
                "resources": {"cpu": "1", "memory": "4Gi"},
            },
            "trainer": {"replicas": 1, "resources": {"cpu": "1", "memory": "4Gi"}},
            "weightSync": {"redis": {"memory": "512Mi", "persistence": True, "storage": "1Gi"}},
            "eval": {"interval": 0},
            "restartLimit": 2,
        },
    }
    for key, value in spec.items():
        doc["spec"].setdefault(key, {}).update(value)
    return doc


def claim(ops: Ops, ns: str, name: str) -> None:
    """A claim of the hostlet's default StorageClass; its provisioner binds it to a host folder."""
    ops.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        },
    )
    wait_for(
        lambda: (ops.json("get", "pvc", name, "-n", ns) or {}).get("status", {}).get("phase") == "Bound",
        timeout=30,
        what=f"claim {name} Bound",
    )


def job_redis(ops: Ops, ns: str, name: str) -> redis.Redis:
    secret = ops.json("get", "secret", f"{name}-redis", "-n", ns)
    return redis.Redis(host="127.0.0.1", port=6379, password=base64.b64decode(secret["data"]["password"]).decode())


def columns(ops: Ops, ns: str, name: str) -> dict[str, str]:
    """`kubectl get rljobs` as a user reads it: header -> cell (cut at the header's offsets, as
    an empty cell prints as blanks)."""
    header, *rows = ops.cluster.kubectl("get", "rljob", name, "-n", ns).stdout.splitlines()
    if not rows:
        return {}
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    cells = [rows[0][a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(header.split(), cells, strict=True))


def watch_columns(ops: Ops, ns: str, name: str, until: str, timeout: float) -> list[dict[str, str]]:
    """Every distinct row `kubectl get rljobs` showed until the phase reached `until`."""
    seen: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = columns(ops, ns, name)
        if row and (
            not seen
            or {k: v for k, v in row.items() if k != "AGE"} != {k: v for k, v in seen[-1].items() if k != "AGE"}
        ):
            seen.append(row)
        if row.get("PHASE") == until:
            return seen
        if row.get("PHASE") == "Failed":
            raise AssertionError(f"{name} failed: {ops.status(ns, name)}")
        time.sleep(1)
    raise AssertionError(f"{name} not {until} after {timeout}s; rows seen: {seen}")


def number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def test_a_small_job_trains_through_the_operators_manifests(ops: Ops, hostlet: HostletProcess, ns: str) -> None:
    ops.apply(ns, real_job("real", steps=4, eval={"interval": 4, "questions": 8}))
    rows = watch_columns(ops, ns, "real", "Succeeded", timeout=600)
    steps = [int(s) for r in rows if (s := r.get("STEP", "<none>")).isdigit()]
    assert any(0 < s < 4 for s in steps) and steps[-1] == 4, rows  # seen advancing, not only at the end
    assert steps == sorted(steps), rows
    versions = [v for r in rows if (v := number(r.get("VERSION", ""))) is not None]
    assert versions and versions[-1] >= 1, rows
    assert any(number(r.get("REWARD", "")) is not None for r in rows), rows
    assert any(r.get("ROLLOUTS") == "1/1" for r in rows), rows

    status = ops.status(ns, "real")
    assert status["evalExactMatch"] is not None and status["evalF1"] is not None, status
    client = job_redis(ops, ns, "real")
    metrics = TrainerMetrics.from_redis(client.hgetall(JobKeys(ns, "real").metrics))
    assert metrics.state == "succeeded"
    assert (status["step"], status["totalSteps"], status["policyVersion"]) == (
        metrics.step,
        metrics.total_steps,
        metrics.policy_version,
    )
    assert status["meanReward"] == pytest.approx(metrics.mean_reward)
    assert (status["evalExactMatch"], status["evalF1"]) == pytest.approx((metrics.eval_exact_match, metrics.eval_f1))
    # The job's own Redis ran as rendered: its password, and its append-only file on the claim.
    (redis_claim,) = (hostlet.root / "claims" / ns).glob("data-real-redis-0")
    assert list(redis_claim.rglob("*.aof")), f"no AOF under {redis_claim}"
    trainer_log = hostlet.container_log(ns, next(p["metadata"]["name"] for p in ops.pods(ns, "trainer", "real")))
    assert "step 4/4" in trainer_log, trainer_log[-2000:]


def test_a_killed_trainer_restarts_the_gang_from_its_checkpoint(ops: Ops, hostlet: HostletProcess, ns: str) -> None:
    claim(ops, ns, "checkpoints")
    ops.apply(ns, real_job("resume", steps=5, trainer={"checkpointVolumeClaim": "checkpoints"}))
    wait_for(lambda: (ops.status(ns, "resume").get("step") or 0) >= 3, timeout=600, what="step 3 (checkpoint at 2)")
    (first,) = ops.pods(ns, "trainer", "resume")
    os.kill(hostlet.pid(ns, first["metadata"]["name"]), signal.SIGKILL)
    wait_for(
        lambda: (
            (ops.json("get", "pod", first["metadata"]["name"], "-n", ns) or {"status": {"phase": "Failed"}})["status"][
                "phase"
            ]
            == "Failed"
            or ops.status(ns, "resume").get("restarts") == 1
        ),
        timeout=60,
        what="the killed trainer's pod Failed",
    )
    wait_for(lambda: ops.status(ns, "resume").get("restarts") == 1, timeout=120, what="one gang restart counted")
    rows = watch_columns(ops, ns, "resume", "Succeeded", timeout=600)
    assert ops.status(ns, "resume")["restarts"] == 1, rows
    (second,) = ops.pods(ns, "trainer", "resume")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    text = hostlet.container_log(ns, second["metadata"]["name"])
    resumed = [line for line in text.splitlines() if "resumed from" in line]
    assert resumed, text[-3000:]
    checkpoint_step = int(resumed[0].rsplit(" ", 1)[1])
    assert checkpoint_step >= 2
    trained = [
        int(line.split("step ", 1)[1].split("/", 1)[0])
        for line in text.splitlines()
        if " step " in line and "/5 " in line
    ]
    assert trained == list(range(checkpoint_step + 1, 6)), trained


def entries_added(client: redis.Redis, stream: str) -> int:
    """Entries ever added to a stream (Redis 7 keeps the count in its AOF too), deleted or not."""
    return int(client.xinfo_stream(stream)["entries-added"])


def step_at_least(ops: Ops, ns: str, name: str, step: int, timeout: float = 600) -> None:
    wait_for(lambda: (ops.status(ns, name).get("step") or 0) >= step, timeout=timeout, what=f"{name} at step {step}")


def restart_count(ops: Ops, ns: str, pod: str) -> int:
    found = ops.json("get", "pod", pod, "-n", ns) or {}
    return sum(c.get("restartCount", 0) for c in found.get("status", {}).get("containerStatuses", []))


def test_a_rollout_worker_killed_mid_batch_loses_no_prompt(ops: Ops, hostlet: HostletProcess, ns: str) -> None:
    """Two deaths mid-batch: the process (its pod restarts it), then the pod itself, force-deleted
    as a lost node's pods are (the Deployment's replacement takes over the prompts it held)."""
    ops.apply(ns, real_job("rkill", steps=5))
    keys = JobKeys(ns, "rkill")
    wait_for(lambda: ops.status(ns, "rkill").get("step") is not None, timeout=300, what="training started")
    client = job_redis(ops, ns, "rkill")

    def holding() -> bool:  # the worker has read prompts it has not answered yet
        try:
            return client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] > 0
        except redis.ResponseError:
            return False

    wait_for(holding, timeout=300, interval=0.2, what="the worker holding prompts")
    (worker,) = ops.pods(ns, "rollout", "rkill")
    (trainer,) = ops.pods(ns, "trainer", "rkill")
    os.kill(hostlet.pid(ns, worker["metadata"]["name"]), signal.SIGKILL)
    wait_for(lambda: restart_count(ops, ns, worker["metadata"]["name"]) >= 1, timeout=60, what="the worker restarted")

    step = ops.status(ns, "rkill").get("step") or 0
    wait_for(
        lambda: (ops.status(ns, "rkill").get("step") or 0) > step and holding(),
        timeout=300,
        interval=0.2,
        what="the restarted worker holding prompts of a later step",
    )
    ops.cluster.kubectl("delete", "pod", worker["metadata"]["name"], "-n", ns, "--grace-period=0", "--force")

    def replaced() -> dict[str, Any] | None:
        pods = [p for p in ops.pods(ns, "rollout", "rkill") if p["metadata"]["uid"] != worker["metadata"]["uid"]]
        return next((p for p in pods if p.get("status", {}).get("phase") == "Running"), None)

    wait_for(lambda: replaced() is not None, timeout=120, what="the Deployment's replacement running")
    replacement = replaced()
    assert replacement is not None
    orphaned = client.xpending_range(
        keys.prompts, ROLLOUT_GROUP, min="-", max="+", count=100, consumername=worker["metadata"]["name"]
    )
    assert orphaned, "the deleted pod held no prompt when it died"
    assert replacement["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    watch_columns(ops, ns, "rkill", "Succeeded", timeout=600)
    status = ops.status(ns, "rkill")
    assert status["restarts"] == 0 and status["step"] == 5
    assert [p["metadata"]["uid"] for p in ops.pods(ns, "trainer", "rkill")] == [trainer["metadata"]["uid"]]
    # Every prompt answered exactly once: as many groups published as prompts enqueued.
    assert entries_added(client, keys.trajectories) == entries_added(client, keys.prompts) == 5 * 2
    # The prompts the deleted pod held were taken over by its replacement.
    log = hostlet.container_log(ns, replacement["metadata"]["name"])
    assert "reclaimed" in log, log[-3000:]
    assert not client.xpending_range(keys.prompts, ROLLOUT_GROUP, min="-", max="+", count=100)


def test_a_killed_redis_restarts_from_its_aof_and_the_job_goes_on(ops: Ops, hostlet: HostletProcess, ns: str) -> None:
    claim(ops, ns, "checkpoints")
    ops.apply(ns, real_job("rdie", steps=5, trainer={"checkpointVolumeClaim": "checkpoints"}))
    step_at_least(ops, ns, "rdie", 2)
    time.sleep(1.5)  # appendfsync everysec: the last second of writes may be lost, as on a node crash
    os.kill(hostlet.pid(ns, "rdie-redis-0"), signal.SIGKILL)
    wait_for(lambda: restart_count(ops, ns, "rdie-redis-0") >= 1, timeout=60, what="redis restarted")
    watch_columns(ops, ns, "rdie", "Succeeded", timeout=600)
    status = ops.status(ns, "rdie")
    assert status["step"] == 5, status  # the final metrics, read after the operator's Redis backoff
    assert status["restarts"] == 0, status  # the trainer reconnected; its gang was not restarted
    client = job_redis(ops, ns, "rdie")
    assert TrainerMetrics.from_redis(client.hgetall(JobKeys(ns, "rdie").metrics)).step == 5


def test_suspend_stops_the_processes_and_resume_continues_from_the_checkpoint(
    ops: Ops, hostlet: HostletProcess, ns: str
) -> None:
    claim(ops, ns, "checkpoints")
    ops.apply(ns, real_job("pause", steps=5, trainer={"checkpointVolumeClaim": "checkpoints"}))
    step_at_least(ops, ns, "pause", 3)
    (trainer,) = ops.pods(ns, "trainer", "pause")
    pid = hostlet.pid(ns, trainer["metadata"]["name"])
    ops.cluster.kubectl("patch", "rljob", "pause", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    ops.wait_phase(ns, "pause", "Suspended", timeout=120)
    wait_for(
        lambda: not ops.pods(ns, "trainer", "pause") and not ops.pods(ns, "rollout", "pause"),
        timeout=120,
        what="trainer and rollout pods gone",
    )
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the trainer process ended with its pod
    ops.cluster.kubectl("patch", "rljob", "pause", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    watch_columns(ops, ns, "pause", "Succeeded", timeout=600)
    (second,) = ops.pods(ns, "trainer", "pause")
    text = hostlet.container_log(ns, second["metadata"]["name"])
    assert any("resumed from" in line for line in text.splitlines()), text[-3000:]
    assert ops.status(ns, "pause")["restarts"] == 0


def test_a_two_member_gang_trains_through_the_rendered_rendezvous(ops: Ops, hostlet: HostletProcess, ns: str) -> None:
    # Evaluations on: rank 1 waits in a collective while rank 0 alone drives them.
    ops.apply(ns, real_job("gang", steps=2, trainer={"replicas": 2}, eval={"interval": 2, "questions": 8}))
    watch_columns(ops, ns, "gang", "Succeeded", timeout=600)
    pods = sorted(ops.pods(ns, "trainer", "gang"), key=lambda p: p["metadata"]["name"])
    assert len(pods) == 2
    logs = [hostlet.container_log(ns, p["metadata"]["name"]) for p in pods]
    assert "step 2/2" in logs[0], logs[0][-3000:]
    assert all(p["status"]["phase"] == "Succeeded" for p in pods)


def test_rollout_workers_grow_with_the_backlog_and_shrink_after_the_cooldown(
    ops: Ops, hostlet: HostletProcess, ns: str
) -> None:
    # The step-0 evaluation enqueues 16 prompts at once: 4 a worker wants 3 workers; training
    # steps owe 2 prompts at a time, which 1 worker serves, once the cooldown has passed.
    scaling = {"minReplicas": 1, "maxReplicas": 3, "pendingPerReplica": 4, "scaleDownCooldownSeconds": 10}
    ops.apply(ns, real_job("scale", steps=8, rollout=scaling, eval={"interval": 8, "questions": 16}))
    rows = watch_columns(ops, ns, "scale", "Succeeded", timeout=600)
    shown = [r["ROLLOUTS"] for r in rows if r.get("ROLLOUTS")]
    grown = next((i for i, cell in enumerate(shown) if cell == "3/3"), None)
    assert grown is not None, shown  # three workers ran at once
    assert any(cell.endswith("/1") for cell in shown[grown:]), shown  # and went back to one while training
    pods = ops.pods(ns, "rollout", "scale")
    assert not [p for p in pods if not p["metadata"].get("deletionTimestamp")], "workers left after success"
