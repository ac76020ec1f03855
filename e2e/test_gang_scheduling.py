"""Gang scheduling on each Kubernetes minor the project supports: the operator renders the Workload
API version the cluster serves (scheduling.k8s.io/v1beta1 on 1.37, v1alpha2 on 1.36), the
scheduler's gang plugin binds a trainer gang whole or not at all, and a failed member restarts the
whole gang. Every test here runs on both control planes (build.sh's default and the previous minor).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from localcluster import LocalCluster, wait_for
from ops import JOB_UID, Ops, fail_pod, operator_session, tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=["current", "previous"])
def kube(request) -> LocalCluster:
    return request.getfixturevalue("cluster" if request.param == "current" else "previous_cluster")


@pytest.fixture(scope="module")
def ops(kube: LocalCluster, tmp_path_factory) -> Iterator[Ops]:
    with operator_session(kube, tmp_path_factory.mktemp("operator") / "operator.log") as ops:
        yield ops


@pytest.fixture
def ns(kube: LocalCluster) -> Iterator[str]:
    name = f"gang-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


def served(ops: Ops, api: str, kind: str, ns: str, name: str) -> dict | None:
    """The object as the API server serves it at exactly that group/version."""
    group, version = api.split("/")
    return ops.json("get", f"{kind}.{version}.{group}", name, "-n", ns, "--show-managed-fields")


def test_the_gang_uses_the_workload_api_version_the_cluster_serves(kube: LocalCluster, ops: Ops, ns: str) -> None:
    api = kube.workload_api
    ops.apply(ns, tiny("wl"))
    trainers = wait_for(lambda: ops.running(ns, "trainer", "wl", 2), timeout=90, what="2 trainers Running")
    workload = served(ops, api, "workloads", ns, "wl-trainer")
    group = served(ops, api, "podgroups", ns, "wl-trainer")
    assert workload is not None and group is not None, f"no Workload or PodGroup at {api}"
    assert workload["spec"]["podGroupTemplates"][0]["schedulingPolicy"] == {"gang": {"minCount": 2}}
    if api.endswith("v1beta1"):
        assert group["spec"]["workloadRef"]["workloadName"] == "wl-trainer"
    else:
        assert group["spec"]["podGroupTemplateRef"]["workload"]["workloadName"] == "wl-trainer"
    # The operator applied these at that version itself: its field manager owns them there.
    managers = {(m["manager"], m["apiVersion"]) for m in workload["metadata"]["managedFields"]}
    assert any(version == api for _, version in managers), managers
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "wl-trainer"} for p in trainers)
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in trainers)


def bound(ops: Ops, ns: str, name: str) -> tuple[int, int]:
    """(trainer pods bound to a node, trainer pods in all)."""
    pods = ops.pods(ns, "trainer", name)
    return sum(1 for p in pods if p["spec"].get("nodeName")), len(pods)


def test_a_gang_larger_than_the_cluster_binds_no_member(ops: Ops, ns: str) -> None:
    # 5 trainers of 60 CPUs on 4 fake nodes of 64: 4 of them fit, the gang does not.
    big = {"replicas": 5, "resources": {"cpu": "60", "memory": "4Gi", "gpus": 1}, "scheduleTimeoutSeconds": 600}
    ops.apply(ns, tiny("big", trainer=big))
    wait_for(lambda: bound(ops, ns, "big")[1] == 5, timeout=60, what="the 5 trainer pods created")

    def judged() -> bool:  # the scheduler has tried each pod and said why it did not bind it
        pods = ops.pods(ns, "trainer", "big")
        return all(
            any(c["type"] == "PodScheduled" and c["status"] == "False" for c in p["status"].get("conditions", []))
            for p in pods
        )

    wait_for(judged, timeout=60, what="the scheduler's verdict on every trainer pod")
    time.sleep(3)
    assert bound(ops, ns, "big") == (0, 5)
    # The same pods without a gang: the scheduler binds the 4 that fit, which the gang prevented.
    ops.cluster.kubectl("delete", "rljob", "big", "-n", ns, "--wait=true")
    # Gone, not just deleted: a gang member waiting at the scheduler's Permit holds its node's room.
    wait_for(lambda: bound(ops, ns, "big")[1] == 0, timeout=60, what="the gang's pods gone")
    ops.apply(ns, tiny("loose", trainer={**big, "gangProvider": "none"}))
    seen = wait_for(lambda: (b := bound(ops, ns, "loose"))[0] >= 4 and b, timeout=90, what="4 loose trainers bound")
    assert seen == (4, 5), ops.cluster.kubectl("get", "pods,events", "-n", ns, "-o", "wide").stdout


def test_trainer_failure_restarts_whole_gang_and_counts_once(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("gang"))
    old = wait_for(lambda: ops.running(ns, "trainer", "gang", 2), timeout=90, what="trainers")
    rollout_before = {p["metadata"]["uid"] for p in wait_for(lambda: ops.running(ns, "rollout", "gang", 1))}
    job_uid = ops.json("get", "job", "gang-trainer", "-n", ns)["metadata"]["uid"]
    fail_pod(ops, ns, old[0]["metadata"]["name"])
    wait_for(lambda: ops.status(ns, "gang").get("restarts") == 1, timeout=30, what="restarts == 1")
    new = wait_for(lambda: ops.running(ns, "trainer", "gang", 2), timeout=90, what="new gang Running")
    old_uids = {p["metadata"]["uid"] for p in old}
    assert not old_uids & {p["metadata"]["uid"] for p in new}, "every member must be replaced"
    assert ops.json("get", "job", "gang-trainer", "-n", ns)["metadata"]["uid"] != job_uid
    time.sleep(3)
    st = ops.status(ns, "gang")
    assert st["restarts"] == 1 and st["phase"] == "Running"
    assert {p["metadata"]["uid"] for p in ops.running(ns, "rollout", "gang", 1) or []} == rollout_before
    reasons = ops.cluster.kubectl("get", "events", "-n", ns, "-o", "jsonpath={.items[*].reason}").stdout
    assert "GangRestart" in reasons


def test_switching_gang_provider_removes_the_old_gang_objects(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("switch"))
    wait_for(lambda: ops.running(ns, "trainer", "switch", 2), timeout=90, what="trainers")
    assert ops.json("get", "workload", "switch-trainer", "-n", ns) is not None
    job_uid = ops.json("get", "job", "switch-trainer", "-n", ns)["metadata"]["uid"]
    ops.cluster.kubectl(
        "patch", "rljob", "switch", "-n", ns, "--type=merge", "-p", '{"spec":{"trainer":{"gangProvider":"none"}}}'
    )

    def new_gang() -> bool:
        pods = ops.running(ns, "trainer", "switch", 2) or []
        return bool(pods) and all(p["metadata"]["labels"].get(JOB_UID) != job_uid for p in pods)

    wait_for(new_gang, timeout=90, what="the gang recreated without a gang provider")
    for kind in ("workloads.scheduling.k8s.io", "podgroups.scheduling.k8s.io"):
        assert ops.json("get", kind, "switch-trainer", "-n", ns) is None, f"{kind} of the old provider left behind"
    assert ops.status(ns, "switch")["restarts"] == 0
