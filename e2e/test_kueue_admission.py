"""RLJobs through Kueue (`spec.queueName`), with Kueue's real manager (e2e/kueue.py): a trainer gang
is admitted whole within its ClusterQueue's quota or waits, with no pod, saying why in the RLJob's
status. The first tests prove the harness itself on plain batch Jobs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kueue import QUEUED_NAMESPACE_LABEL, running_kueue
from localcluster import LocalCluster, wait_for
from ops import Ops, operator_session, tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@pytest.fixture(scope="module")
def kueue(cluster: LocalCluster, tmp_path_factory) -> Iterator[LocalCluster]:
    with running_kueue(cluster, tmp_path_factory.mktemp("kueue") / "kueue.log"):
        yield cluster


def kubectl_json(cluster: LocalCluster, *args: str) -> Any:
    out = cluster.kubectl(*args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def apply(cluster: LocalCluster, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))


@pytest.fixture
def queue(kueue: LocalCluster) -> Iterator[str]:
    """A namespace with LocalQueue `team` on a ClusterQueue of 8 GPUs; yields the namespace."""
    ns = f"kq-{uuid.uuid4().hex[:6]}"
    apply(kueue, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": QUEUED_NAMESPACE_LABEL}})
    resources = [("cpu", "1000"), ("memory", "10Ti"), ("nvidia.com/gpu", "8")]
    apply(
        kueue,
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default"}},
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": ns},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [name for name, _ in resources],
                        "flavors": [
                            {
                                "name": "default",
                                "resources": [{"name": name, "nominalQuota": quota} for name, quota in resources],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "team", "namespace": ns},
            "spec": {"clusterQueue": ns},
        },
    )
    yield ns
    # The jobs go while the operator and Kueue still run (Kueue's finalizers need its manager);
    # their pods follow in the background.
    kueue.kubectl("delete", "rljobs", "--all", "-n", ns, "--timeout=60s", check=False, timeout=90)
    kueue.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    kueue.kubectl("delete", "clusterqueue", ns, "--wait=false", check=False)


def gpu_job(name: str, pods: int) -> dict[str, Any]:
    container = {"name": "c", "image": "none", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: "team"}},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


def pods_of(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    return (kubectl_json(cluster, "get", "pods", "-n", ns, "-l", f"job-name={job}") or {}).get("items", [])


def reservation(cluster: LocalCluster, ns: str, job: str) -> dict[str, Any]:
    """The QuotaReserved condition of the Kueue Workload made for `job`."""
    for wl in (kubectl_json(cluster, "get", "workloads.kueue.x-k8s.io", "-n", ns) or {}).get("items", []):
        if any(ref.get("name") == job for ref in wl["metadata"].get("ownerReferences", [])):
            return next((c for c in wl.get("status", {}).get("conditions", []) if c["type"] == "QuotaReserved"), {})
    return {}


def test_queued_jobs_are_admitted_whole_within_quota_and_the_waiting_one_says_why(kueue: LocalCluster, queue: str):
    for name in ("first", "second"):
        kueue.kubectl("apply", "-n", queue, "-f", "-", input=json.dumps(gpu_job(name, 8)))
    wait_for(lambda: len(pods_of(kueue, queue, "first")) == 8, timeout=60, what="the first job's 8 pods")
    wait_for(lambda: reservation(kueue, queue, "second").get("status") == "False", timeout=60, what="second waits")
    assert kubectl_json(kueue, "get", "job", "second", "-n", queue)["spec"]["suspend"] is True
    assert pods_of(kueue, queue, "second") == []
    assert "insufficient unused quota for nvidia.com/gpu" in reservation(kueue, queue, "second")["message"], (
        reservation(kueue, queue, "second")
    )
    kueue.kubectl("delete", "job", "first", "-n", queue, "--wait=true")
    wait_for(lambda: len(pods_of(kueue, queue, "second")) == 8, timeout=90, what="the second job admitted")


def test_a_job_larger_than_its_quota_is_never_admitted_and_says_so(kueue: LocalCluster, queue: str):
    kueue.kubectl("apply", "-n", queue, "-f", "-", input=json.dumps(gpu_job("huge", 16)))
    wait_for(lambda: reservation(kueue, queue, "huge").get("status") == "False", timeout=60, what="huge waits")
    message = reservation(kueue, queue, "huge")["message"]
    assert "nvidia.com/gpu" in message, message
    assert pods_of(kueue, queue, "huge") == []


@pytest.fixture(scope="module")
def ops(kueue: LocalCluster, tmp_path_factory) -> Iterator[Ops]:
    with operator_session(kueue, tmp_path_factory.mktemp("operator") / "operator.log") as ops:
        yield ops


def gang_of_gpus(name: str, members: int) -> dict[str, Any]:
    """examples/rljob-tiny.yaml with a trainer gang of `members` x 1 GPU, queued on `team`."""
    trainer = {"replicas": members, "resources": {"cpu": "1", "memory": "1Gi", "gpus": 1}}
    return tiny(name, queueName="team", trainer=trainer)


def test_two_rljobs_on_an_8_gpu_queue_run_one_after_the_other(ops: Ops, queue: str) -> None:
    ops.apply(queue, gang_of_gpus("first", 8))
    wait_for(lambda: ops.running(queue, "trainer", "first", 8), timeout=120, what="the first gang Running")
    ops.wait_phase(queue, "first", "Running", timeout=60)
    ops.apply(queue, gang_of_gpus("second", 8))
    ops.wait_phase(queue, "second", "Queued", timeout=60)
    # The operator says "waiting for Kueue" at once; Kueue's own reason follows once its Workload has
    # tried the quota, which on a slow machine can be a pass or two later.
    wait_for(
        lambda: "insufficient unused quota" in ops.condition(queue, "second", "TrainersReady").get("message", ""),
        timeout=60,
        what="Kueue's reason in TrainersReady",
    )
    trainers = ops.condition(queue, "second", "TrainersReady")
    assert trainers["reason"] == "Queued", trainers
    assert "LocalQueue team" in trainers["message"] and "insufficient unused quota" in trainers["message"]
    # While it waits, not one of its trainer pods exists (its rollout pool, CPU only, runs).
    for _ in range(10):
        assert ops.pods(queue, "trainer", "second") == []
        time.sleep(1)
    assert ops.status(queue, "second")["phase"] == "Queued"
    # Each rollout pod went through Kueue too: a Workload of its own, admitted within the quota.
    (worker,) = wait_for(lambda: ops.running(queue, "rollout", "second", 1), timeout=60, what="second's rollout pod")
    assert worker["metadata"]["labels"][QUEUE_LABEL] == "team"
    (admitted,) = [
        wl
        for wl in kubectl_json(ops.cluster, "get", "workloads.kueue.x-k8s.io", "-n", queue)["items"]
        if any(ref["name"] == worker["metadata"]["name"] for ref in wl["metadata"].get("ownerReferences", []))
    ]
    assert any(c["type"] == "Admitted" and c["status"] == "True" for c in admitted["status"]["conditions"])
    ops.cluster.kubectl("delete", "rljob", "first", "-n", queue, "--wait=false")
    wait_for(lambda: ops.running(queue, "trainer", "second", 8), timeout=180, what="the second gang admitted")
    ops.wait_phase(queue, "second", "Running", timeout=60)


def test_a_gang_larger_than_its_queue_is_reported(ops: Ops, queue: str) -> None:
    ops.apply(queue, gang_of_gpus("huge", 16))
    wait_for(
        lambda: ops.condition(queue, "huge", "TrainersReady").get("reason") == "QuotaExceedsQueue",
        timeout=60,
        what="QuotaExceedsQueue",
    )
    message = ops.condition(queue, "huge", "TrainersReady")["message"]
    assert "can never fit" in message and "maximum capacity (8)" in message, message
    assert ops.status(queue, "huge")["phase"] == "Queued"
    assert ops.pods(queue, "trainer", "huge") == []
