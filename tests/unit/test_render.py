"""Rendering is pure: each child for each option, owner references, security, env and idempotence."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from rljob.config import RLJob, load_rljob
from rljob_operator.render import (
    RenderPlan,
    render_children,
    render_keda,
    render_redis_secret,
    rollout_hash,
    trainer_hash,
)

PLAN = RenderPlan(uid="uid-1", rollout_replicas=3)


def make(spec: dict[str, Any] | None = None, name: str = "job") -> RLJob:
    return RLJob.model_validate({"metadata": {"name": name, "namespace": "ns"}, "spec": spec or {}})


def by_kind(children: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind]
    return found


def env_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec["containers"][0]["env"]}


def test_every_child_has_a_controller_owner_reference_and_labels() -> None:
    children = render_children(make(), PLAN)
    kinds = [c["kind"] for c in children]
    assert kinds == [
        "ConfigMap",
        "Service",
        "StatefulSet",
        "NetworkPolicy",
        "Deployment",
        "Service",
        "Workload",
        "PodGroup",
        "Job",
    ]
    for child in children:
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "rljob.dev/v1alpha1",
            "kind": "RLJob",
            "name": "job",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["labels"]["rljob.dev/job"] == "job"


def test_rendering_is_deterministic() -> None:
    job = make({"trainer": {"replicas": 3}})
    assert render_children(job, PLAN) == render_children(job, PLAN)


def test_config_map_holds_the_manifest_workers_read_back() -> None:
    job = make({"grpo": {"groupSize": 6}})
    cm = by_kind(render_children(job, PLAN), "ConfigMap")
    doc = yaml.safe_load(cm["data"]["job.yaml"])
    assert RLJob.model_validate(doc) == job
    assert doc["metadata"] == {"name": "job", "namespace": "ns"}


def test_trainer_job_is_an_indexed_gang_with_rendezvous_env() -> None:
    job = make({"trainer": {"replicas": 4, "resources": {"gpus": 1}}})
    tj = by_kind(render_children(job, PLAN), "Job")
    spec = tj["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0  # the Job controller never replaces a single member
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "job-trainer" and pod["restartPolicy"] == "Never"
    env = env_of(pod)
    assert env["MASTER_ADDR"] == "job-trainer-0.job-trainer.ns.svc"
    assert env["WORLD_SIZE"] == "4" and env["MASTER_PORT"] == "29500"
    assert "job-completion-index" in env["RANK"]["fieldRef"]["fieldPath"]
    assert env["RLJOB_CONFIG"] == "/etc/rljob/job.yaml"
    assert env["RLJOB_REDIS_URL"] == "redis://job-redis.ns.svc:6379/0"
    assert env["RLJOB_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "job-redis", "key": "password"}}
    container = pod["containers"][0]
    assert container["command"] == ["rljob", "train"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"mountPath": "/etc/rljob", "name": "config", "readOnly": True} in container["volumeMounts"]
    svc = [c for c in render_children(job, PLAN) if c["kind"] == "Service" and c["metadata"]["name"] == "job-trainer"]
    assert svc[0]["spec"]["clusterIP"] == "None"


def test_workers_run_as_non_root_without_privilege_escalation() -> None:
    for child in render_children(make(), PLAN):
        template = child.get("spec", {}).get("template")
        if not template:
            continue
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}


def test_no_secret_value_in_rendered_children() -> None:
    password = "s3cr3t-value"
    text = yaml.safe_dump(render_children(make(), PLAN))
    assert password not in text
    secret = render_redis_secret(make(), PLAN, password)
    assert secret["stringData"] == {"password": password}
    sts = by_kind(render_children(make(), PLAN), "StatefulSet")
    script = sts["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert 'requirepass "$REDIS_PASSWORD"' in script and "--appendonly yes" in script


def test_redis_memory_limit_and_persistence_options() -> None:
    sts = by_kind(
        render_children(make({"weightSync": {"redis": {"memory": "1Gi", "persistence": False}}}), PLAN), "StatefulSet"
    )
    script = sts["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert f"--maxmemory {int(2**30 * 0.8)}" in script and "--appendonly no" in script
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "persistentVolumeClaimRetentionPolicy" not in sts["spec"]
    persistent = by_kind(render_children(make(), PLAN), "StatefulSet")
    assert persistent["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    # The claim goes with the RLJob (a new job of the same name must not load the old AOF).
    policy = persistent["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert policy == {"whenDeleted": "Delete", "whenScaled": "Retain"}


def test_network_policy_admits_only_job_pods_and_operator() -> None:
    np = by_kind(render_children(make(), PLAN), "NetworkPolicy")
    peers = np["spec"]["ingress"][0]["from"]
    assert peers[0] == {"podSelector": {"matchLabels": {"rljob.dev/job": "job"}}}
    assert peers[1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "rljob-system"}
    assert len(peers) == 2


def test_external_redis_renders_no_managed_redis() -> None:
    job = make({"weightSync": {"redis": {"externalUrl": "rediss://cache.example:6380/2", "passwordSecret": "ext"}}})
    children = render_children(job, PLAN)
    assert not [c for c in children if c["kind"] in ("StatefulSet", "NetworkPolicy")]
    env = env_of(by_kind(children, "Deployment")["spec"]["template"]["spec"])
    assert env["RLJOB_REDIS_URL"] == "rediss://cache.example:6380/2"
    assert env["RLJOB_REDIS_PASSWORD"]["secretKeyRef"]["name"] == "ext"


def test_rollout_replicas_and_keda_option() -> None:
    deploy = by_kind(render_children(make(), PLAN), "Deployment")
    assert deploy["spec"]["replicas"] == 3
    assert deploy["spec"]["template"]["spec"]["containers"][0]["command"] == ["rljob", "rollout"]
    keda = make({"rollout": {"autoscaler": "keda", "minReplicas": 1, "maxReplicas": 6, "pendingPerReplica": 5}})
    children = render_children(keda, PLAN)
    assert "replicas" not in by_kind(children, "Deployment")["spec"]  # the HPA owns it
    scaled = by_kind(children, "ScaledObject")["spec"]
    train, evaluation = scaled["triggers"]  # the workers serve both streams
    assert train["type"] == evaluation["type"] == "redis-streams"
    assert train["metadata"]["stream"] == "rljob:{ns/job}:prompts"
    assert evaluation["metadata"]["stream"] == "rljob:{ns/job}:eval:prompts"
    for trigger in (train, evaluation):
        assert trigger["metadata"]["consumerGroup"] == "rollout" and trigger["metadata"]["lagCount"] == "5"
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (1, 6)
    auth = by_kind(children, "TriggerAuthentication")["spec"]["secretTargetRef"][0]
    assert auth == {"parameter": "password", "name": "job-redis", "key": "password"}
    paused = render_keda(keda, RenderPlan(uid="u", rollout_replicas=0))
    assert paused[1]["metadata"]["annotations"] == {"autoscaling.keda.sh/paused-replicas": "0"}
    assert render_keda(make(), PLAN) == []


def test_suspend_sets_job_suspend_and_zero_rollouts() -> None:
    plan = RenderPlan(uid="u", rollout_replicas=0, trainers_suspended=True)
    children = render_children(make({"suspend": True}), plan)
    assert by_kind(children, "Job")["spec"]["suspend"] is True
    assert by_kind(children, "Deployment")["spec"]["replicas"] == 0


@pytest.mark.parametrize(
    ("change", "trainer_changes", "rollout_changes"),
    [
        ({"rollout": {"maxReplicas": 9}}, False, False),
        ({"rollout": {"image": "img:2"}}, False, True),
        ({"grpo": {"learningRate": 1e-4}}, True, False),
        ({"trainer": {"replicas": 2}}, True, False),
        ({"suspend": True}, False, False),
        ({"agent": {"topK": 5}}, True, True),
        # Only Redis reads these, but they restart it, and workers do not survive a Redis restart:
        # a planned gang restart and roll, rather than crashes counted against restartLimit.
        ({"weightSync": {"redis": {"memory": "8Gi"}}}, True, True),
        ({"weightSync": {"redis": {"image": "redis:7.4.1-alpine"}}}, True, True),
    ],
)
def test_which_changes_roll_which_role(change: dict, trainer_changes: bool, rollout_changes: bool) -> None:
    base, changed = make(), make(change)
    assert (trainer_hash(base) != trainer_hash(changed)) is trainer_changes
    assert (rollout_hash(base) != rollout_hash(changed)) is rollout_changes


def test_data_volume_and_checkpoint_claim() -> None:
    job = make({"data": {"volumeClaim": "hotpot"}, "trainer": {"checkpointVolumeClaim": "ckpt"}})
    pod = by_kind(render_children(job, PLAN), "Job")["spec"]["template"]["spec"]
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    assert claims["data"] == "hotpot" and claims["checkpoints"] == "ckpt"


def test_examples_render() -> None:
    job = load_rljob("examples/rljob-search-r1.yaml")
    children = render_children(job, PLAN)
    deploy = by_kind(children, "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
