"""Proof that e2e/cluster is a real control plane: scheduling, RBAC, versions, the Workload API."""

from __future__ import annotations

import json
import uuid

import pytest

from localcluster import wait_for


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_warm_start_is_under_a_minute(cluster):
    # The build is excluded: this is the start of etcd through Ready nodes.
    assert cluster.start_seconds < 60, f"cluster took {cluster.start_seconds:.1f}s to start"


def test_nodes_ready_with_gpu_capacity(cluster):
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert len(nodes) == 4
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["status"]["capacity"]["cpu"] == "64"


def test_deployment_pods_run_on_fake_nodes(cluster, namespace):
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-app", "namespace": namespace},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "gpu-app"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-app"}},
                "spec": {
                    "containers": [
                        {"name": "main", "image": "busybox:1.36", "resources": {"limits": {"nvidia.com/gpu": "2"}}}
                    ]
                },
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def running_pods():
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=gpu-app", "-o", "json").stdout)
        items = pods["items"]
        return items if len(items) == 3 and all(p["status"].get("phase") == "Running" for p in items) else None

    pods = wait_for(running_pods, what="3 Running pods")
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in pods)
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "deployment", "gpu-app", "-n", namespace, "-o", "jsonpath={.status.readyReplicas}"
            ).stdout
            == "3"
        ),
        what="deployment ready replicas",
    )


def test_pod_asking_too_many_gpus_stays_pending(cluster, namespace):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big", "namespace": namespace},
        "spec": {
            "containers": [{"name": "main", "image": "busybox:1.36", "resources": {"limits": {"nvidia.com/gpu": "16"}}}]
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

    def scheduling_event():
        events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        return [e for e in events if e["reason"] == "FailedScheduling" and e["involvedObject"]["name"] == "too-big"]

    events = wait_for(scheduling_event, what="a FailedScheduling event")
    assert "nvidia.com/gpu" in events[0]["message"]
    phase = cluster.kubectl("get", "pod", "too-big", "-n", namespace, "-o", "jsonpath={.status.phase}").stdout
    assert phase == "Pending"


def test_rbac_answers_per_rules(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl("create", "role", "pod-reader", "-n", namespace, "--verb=get,list,watch", "--resource=pods")
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader-binding",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
    )
    who = f"--as=system:serviceaccount:{namespace}:reader"

    def can(*args: str) -> str:
        return cluster.kubectl("auth", "can-i", *args, "-n", namespace, who, check=False).stdout.strip()

    wait_for(lambda: can("list", "pods") == "yes", what="RBAC to allow list pods")
    assert can("delete", "pods") == "no"
    assert can("list", "secrets") == "no"
    assert cluster.kubectl("auth", "can-i", "list", "pods", "-n", "default", who, check=False).stdout.strip() == "no"


def test_versions_are_real(cluster):
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == cluster.kube_version  # as built, not v0.0.0
    assert versions["clientVersion"]["gitVersion"] == cluster.kube_version
    helm = cluster.helm("version", "--short").stdout.strip()
    assert helm.startswith("v3."), helm
    assert "v3.0.0" not in helm and "unknown" not in helm


def test_workload_api_is_served(cluster):
    resources = cluster.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").stdout.split()
    assert any(r.startswith("workloads.") for r in resources), resources
    versions = cluster.kubectl("api-versions").stdout.split()
    assert cluster.workload_api in versions, versions
