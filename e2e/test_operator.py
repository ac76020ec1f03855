"""The operator against the real control plane: chart, RBAC, children, pods on kwok GPU nodes,
validation, preflight failures, restarts of the operator, suspend/resume, deletion (gang
scheduling and gang restarts, on each Kubernetes minor: test_gang_scheduling.py).

The chart is installed with replicaCount=0 and the operator runs from source with the chart's
ServiceAccount token, so every test also proves the chart's RBAC is sufficient.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import wait_for
from ops import CHART, OP_NS, ROOT, SA, Ops, fail_pod, operator_session, tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SEARCH_R1 = yaml.safe_load((ROOT / "examples" / "rljob-search-r1.yaml").read_text())


@pytest.fixture(scope="module")
def ops(cluster, tmp_path_factory) -> Iterator[Ops]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with operator_session(cluster, log, provoked_error=PROVOKED_ERROR) as ops:
        yield ops


# The webhook name in the API error a test provokes on purpose (kopf logs each retried pass's traceback).
PROVOKED_ERROR = "down.rljob-e2e.test"


@pytest.fixture
def ns(cluster) -> Iterator[str]:
    name = f"op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_chart_lints_and_renders(cluster, tmp_path: Path) -> None:
    assert "0 chart(s) failed" in cluster.helm("lint", str(CHART)).stdout
    assert "0 chart(s) failed" in cluster.helm("lint", str(CHART), "--set", "replicaCount=0").stdout
    bad = cluster.helm("lint", str(CHART), "--set", "replicaCount=3", check=False)
    assert bad.returncode != 0 and "replicaCount" in bad.stdout + bad.stderr
    rendered = cluster.helm("template", "r", str(CHART), "--include-crds").stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
    } <= kinds
    # `--set` hands decimals over as strings: a positive one is a valid interval, anything else not.
    fast = cluster.helm("template", "r", str(CHART), "--set", "operator.timerInterval=0.5").stdout
    env = next(d for d in yaml.safe_load_all(fast) if d and d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in env["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_TIMER_INTERVAL"] == "0.5"
    for bad_value in ("0", "-1", "soon"):
        bad = cluster.helm("template", "r", str(CHART), "--set", f"operator.timerInterval={bad_value}", check=False)
        assert bad.returncode != 0 and "timerInterval" in bad.stdout + bad.stderr, bad_value
    # One port for metrics and liveness would crash-loop the operator (address in use): refused here.
    clash = cluster.helm("template", "r", str(CHART), "--set", "liveness.port=8080", check=False)
    assert clash.returncode != 0 and "metrics.port and liveness.port" in clash.stderr, clash.stderr
    # As a subchart: an umbrella chart hands it `global` and its `enabled` condition.
    assert cluster.helm("template", "r", str(CHART), "--set", "global.x=1").returncode == 0
    umbrella = tmp_path / "platform"
    shutil.copytree(CHART, umbrella / "charts" / "rljob")
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (umbrella / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "0.1.0",
                "dependencies": [{"name": "rljob", "version": version, "condition": "rljob.enabled"}],
            }
        )
    )
    (umbrella / "values.yaml").write_text(yaml.safe_dump({"global": {"x": 1}, "rljob": {"enabled": True}}))
    rendered = cluster.helm("template", "p", str(umbrella)).stdout
    assert any(d and d["kind"] == "Deployment" for d in yaml.safe_load_all(rendered))


def test_explain_teaches_the_api(ops: Ops) -> None:
    out = ops.cluster.kubectl("explain", "rljob.spec.grpo").stdout
    assert "groupSize" in out and "Samples per question" in out
    assert "learningRate" in ops.cluster.kubectl("explain", "rljob.spec.grpo.learningRate").stdout


def test_happy_path_children_pods_status_columns(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny())
    kinds = wait_for(
        lambda: (k := sorted(c["kind"] for c in ops.children(ns, "tiny"))) and len(k) >= 10 and k,
        timeout=60,
        what="all children",
    )
    assert kinds == sorted(
        [
            "ConfigMap",
            "Secret",
            "Service",
            "Service",
            "StatefulSet",
            "NetworkPolicy",
            "Deployment",
            "Job",
            "Workload",
            "PodGroup",
        ]
    )
    uid = ops.rljob(ns, "tiny")["metadata"]["uid"]
    for child in ops.children(ns, "tiny"):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True, child["metadata"]["name"]
    trainers = wait_for(lambda: ops.running(ns, "trainer", "tiny", 2), timeout=90, what="2 trainers Running")
    indexes = sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in trainers)
    assert indexes == ["0", "1"]
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in trainers)
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "tiny-trainer"} for p in trainers)
    wait_for(lambda: ops.running(ns, "rollout", "tiny", 1), timeout=60, what="rollout Running")
    ops.wait_phase(ns, "tiny", "Running", timeout=30)
    st = ops.status(ns, "tiny")
    assert st["observedGeneration"] == 1 and st["restarts"] == 0
    assert ops.condition(ns, "tiny", "TrainersReady")["status"] == "True"
    # No Redis is reachable from the host for kwok pods: a condition, not a crash.
    assert ops.condition(ns, "tiny", "MetricsAvailable")["reason"] in ("RedisUnreachable", "NoMetricsYet")
    table = ops.cluster.kubectl("get", "rljobs", "-n", ns).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STEP", "REWARD", "EM", "VERSION", "ROLLOUTS", "AGE"]
    assert table.splitlines()[1].split()[:2] == ["tiny", "Running"]
    # The generated password never shows in status or events.
    secret = ops.json("get", "secret", "tiny-redis", "-n", ns)
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32
    events = ops.cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert password not in json.dumps(ops.rljob(ns, "tiny")) and password not in events
    assert password not in ops.operator.log_tail(10**7)


def test_search_r1_example_gets_gpus(ops: Ops, ns: str) -> None:
    # The example's checkpoint claim, created first as its header says: the preflight wants it to
    # exist and the scheduler wants it bound. This cluster has no provisioner, so a volume is made
    # for it and bound to it by name (kwok never mounts it).
    claim = SEARCH_R1["spec"]["trainer"]["checkpointVolumeClaim"]
    volume = f"{ns}-{claim}"
    size = {"storage": "1Gi"}
    ops.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": size,
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{volume}"},
                "claimRef": {"namespace": ns, "name": claim},
            },
        },
    )
    ops.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": size},
            },
        },
    )
    wait_for(
        lambda: (ops.json("get", "pvc", claim, "-n", ns) or {}).get("status", {}).get("phase") == "Bound",
        timeout=60,
        what=f"claim {claim} Bound",
    )
    ops.apply(ns, SEARCH_R1)
    name = SEARCH_R1["metadata"]["name"]
    trainers = wait_for(lambda: ops.running(ns, "trainer", name, 2), timeout=90, what="GPU trainers Running")
    rollouts = wait_for(lambda: ops.running(ns, "rollout", name, 4), timeout=90, what="GPU rollouts Running")
    for role, pods in (("trainer", trainers), ("rollout", rollouts)):
        for pod in pods:
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert pod["spec"]["containers"][0]["image"] == SEARCH_R1["spec"][role]["image"]
    for pod in trainers:
        claims = [v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]]
        assert claim in claims
    assert ops.status(ns, name)["rolloutReplicasDesired"] == 4
    ops.cluster.kubectl("delete", "rljob", name, "-n", ns, "--wait=false")
    ops.cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)


INVALID = [
    ({"rollout": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <= maxReplicas"),
    ({"grpo": {"groupSize": 1}}, "spec.grpo.groupSize"),
    ({"trainer": {"gangProvider": "yunikorn"}}, "spec.trainer.gangProvider"),
    ({"rollout": {"engine": "tgi"}}, "spec.rollout.engine"),
    ({"grpo": {"learningRate": 0}}, "spec.grpo.learningRate"),
    ({"agent": {"maxNewTokensPerTurn": 1024, "maxTotalTokens": 512}}, "maxNewTokensPerTurn"),
    ({"grpo": {"microBatchSize": 64, "groupSize": 2, "questionsPerStep": 2}}, "microBatchSize"),
    ({"weightSync": {"redis": {"externalUrl": "redis://r:6379"}}}, "passwordSecret"),
    ({"rollout": {"engine": "vllm", "resources": {"gpus": 0}}}, "engine vllm needs resources.gpus"),
    ({"grpo": {"groupsize": 4}}, "spec.grpo.groupsize"),
    ({"rollout": {"resources": {"memory": "lots"}}}, "spec.rollout.resources.memory"),
    (
        {"weightSync": {"redis": {"externalUrl": "http://r", "passwordSecret": "s"}}},
        "spec.weightSync.redis.externalUrl",
    ),
    # A port the operator's URL parsing would choke on; an empty Secret or image name.
    (
        {"weightSync": {"redis": {"externalUrl": "redis://r:6379x", "passwordSecret": "s"}}},
        "spec.weightSync.redis.externalUrl",
    ),
    (
        {"weightSync": {"redis": {"externalUrl": "redis://r:6379", "passwordSecret": ""}}},
        "spec.weightSync.redis.passwordSecret",
    ),
    ({"weightSync": {"redis": {"image": ""}}}, "spec.weightSync.redis.image"),
    ({"agent": {"temperature": 0}}, "spec.agent.temperature"),  # greedy groups: GRPO would never update
    ({"trainer": {"replicas": 0}}, "spec.trainer.replicas"),
    ({"restartLimit": -1}, "spec.restartLimit"),
    ({"trainer": {"resources": {"gpus": 2}}}, "one rank on one GPU"),
    ({"rollout": {"resources": {"gpus": 2}}}, "engine hf serves from one GPU"),
    (
        {"model": {"name": "m", "ggufFile": "m.gguf"}, "rollout": {"engine": "vllm", "resources": {"gpus": 1}}},
        "cannot serve model.ggufFile",
    ),
    ({"eval": {"split": "validation"}}, "eval.split validation scores the validation slice"),
]


def test_invalid_manifests_are_rejected_naming_the_field(ops: Ops, ns: str) -> None:
    messages = []
    for change, needle in INVALID:
        result = ops.apply(ns, tiny("bad", **change), check=False)
        messages.append(result.stderr)
        assert result.returncode != 0, f"{change} was accepted"
        assert needle in result.stderr, f"{change}: {result.stderr}"
    long_name = ops.apply(ns, tiny("x" * 41), check=False)
    assert long_name.returncode != 0 and "metadata.name must be at most 40" in long_name.stderr
    for name in ("qwen2.5-grpo", "7b-run"):  # valid resource names, but not valid Service names
        refused = ops.apply(ns, tiny(name), check=False)
        assert refused.returncode != 0 and "metadata.name must start with a lowercase letter" in refused.stderr
    assert len(set(messages)) == len(INVALID)
    assert ops.json("get", "rljobs", "-n", ns)["items"] == []


def test_immutable_fields_refused_with_message(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("imm"))
    changed = tiny("imm")
    changed["spec"]["model"] = {"name": "Qwen/Qwen2.5-0.5B-Instruct"}
    result = ops.apply(ns, changed, check=False)
    assert result.returncode != 0 and "spec.model is immutable" in result.stderr
    # The managed Redis volume: a StatefulSet's claim template cannot change, so neither can these.
    for redis in ({"storage": "20Gi"}, {"persistence": True}):  # tiny has persistence false, storage 10Gi
        changed = tiny("imm")
        changed["spec"]["weightSync"]["redis"].update(redis)
        result = ops.apply(ns, changed, check=False)
        assert result.returncode != 0 and "managed Redis volume" in result.stderr, result.stderr


def test_unschedulable_spec_fails_without_children(ops: Ops, ns: str) -> None:
    # Valid to the schema, impossible on this cluster: no Volcano installed.
    ops.apply(ns, tiny("novolcano", trainer={"gangProvider": "volcano"}))
    ops.wait_phase(ns, "novolcano", "Failed", timeout=30)
    failed = ops.condition(ns, "novolcano", "Failed")
    assert failed["status"] == "True" and failed["reason"] == "GangProviderUnavailable"
    assert "scheduling.volcano.sh" in failed["message"]
    # A missing external Redis Secret degrades (and recovers when it appears); nothing half-built.
    ext = {"redis": {"externalUrl": "redis://redis.example:6379/0", "passwordSecret": "ext-redis"}}
    ops.apply(ns, tiny("nosecret", weightSync=ext))
    wait_for(
        lambda: ops.condition(ns, "nosecret", "Ready").get("reason") == "RedisSecretNotFound",
        timeout=30,
        what="RedisSecretNotFound",
    )
    assert ops.status(ns, "nosecret")["phase"] == "Pending"
    time.sleep(2)
    assert ops.children(ns, "novolcano") == [] and ops.children(ns, "nosecret") == []
    reasons = ops.cluster.kubectl("get", "events", "-n", ns, "-o", "jsonpath={.items[*].reason}").stdout
    assert "PhaseFailed" in reasons
    ops.cluster.kubectl("create", "secret", "generic", "ext-redis", "-n", ns, "--from-literal=password=pw")
    wait_for(lambda: ops.running(ns, "trainer", "nosecret", 2), timeout=60, what="recovered after Secret appears")
    kinds = {c["kind"] for c in ops.children(ns, "nosecret")}
    assert "StatefulSet" not in kinds and "Job" in kinds


def test_operator_restart_mid_reconcile_creates_no_duplicates(ops: Ops, ns: str) -> None:
    ops.operator.stop(kill=True)
    ops.apply(ns, tiny("restart"))
    ops.operator.start()
    time.sleep(0.4)  # let it begin reconciling, then kill it again mid-way
    ops.operator.stop(kill=True)
    ops.operator.start()
    wait_for(lambda: ops.running(ns, "trainer", "restart", 2), timeout=90, what="trainers after restarts")
    kinds = sorted(c["kind"] for c in ops.children(ns, "restart"))
    assert kinds.count("Job") == 1 and kinds.count("Deployment") == 1 and kinds.count("Secret") == 1
    assert len(kinds) == 10
    time.sleep(3)
    assert len(ops.pods(ns, "trainer", "restart")) == 2 and len(ops.pods(ns, "rollout", "restart")) == 1


def test_suspend_and_resume(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("sus"))
    wait_for(lambda: ops.running(ns, "trainer", "sus", 2), timeout=90, what="trainers")
    secret_uid = ops.json("get", "secret", "sus-redis", "-n", ns)["metadata"]["uid"]
    ops.cluster.kubectl("patch", "rljob", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for(
        lambda: not ops.pods(ns, "trainer", "sus") and not ops.pods(ns, "rollout", "sus"),
        timeout=60,
        what="pods deleted on suspend",
    )
    ops.wait_phase(ns, "sus", "Suspended", timeout=30)
    assert ops.json("get", "configmap", "sus-config", "-n", ns) is not None
    assert ops.json("get", "secret", "sus-redis", "-n", ns)["metadata"]["uid"] == secret_uid
    assert ops.json("get", "job", "sus-trainer", "-n", ns)["spec"]["suspend"] is True
    ops.cluster.kubectl("patch", "rljob", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for(lambda: ops.running(ns, "trainer", "sus", 2), timeout=90, what="trainers after resume")
    wait_for(lambda: ops.running(ns, "rollout", "sus", 1), timeout=60, what="rollout after resume")
    ops.wait_phase(ns, "sus", "Running", timeout=30, what="Running again")
    assert ops.status(ns, "sus")["restarts"] == 0


def test_deleted_children_come_back(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("heal"))
    wait_for(lambda: ops.running(ns, "trainer", "heal", 2), timeout=90, what="trainers")
    gone = [
        ("service", "heal-trainer"),
        ("configmap", "heal-config"),
        ("service", "heal-redis"),
        ("networkpolicy", "heal-redis"),
    ]
    uids = {}
    for kind, name in gone:
        uids[kind, name] = ops.json("get", kind, name, "-n", ns)["metadata"]["uid"]
        ops.cluster.kubectl("delete", kind, name, "-n", ns)

    def back() -> bool:
        found = {(kind, name): ops.json("get", kind, name, "-n", ns) for kind, name in gone}
        return all(obj and obj["metadata"]["uid"] != uids[key] for key, obj in found.items())

    wait_for(back, timeout=60, what="the deleted children recreated")
    # The trainers' rendezvous address resolves through the headless Service: it must be there
    # again before a new gang starts. A member fails; the gang is replaced and runs.
    ops.cluster.kubectl("delete", "service", "heal-trainer", "-n", ns)
    fail_pod(ops, ns, ops.pods(ns, "trainer", "heal")[0]["metadata"]["name"])
    wait_for(lambda: ops.status(ns, "heal").get("restarts") == 1, timeout=30, what="restarts == 1")
    wait_for(lambda: ops.running(ns, "trainer", "heal", 2), timeout=90, what="the new gang")
    assert ops.json("get", "service", "heal-trainer", "-n", ns) is not None


def test_a_recreated_job_does_not_adopt_its_deleted_namesakes_secret(ops: Ops, ns: str) -> None:
    """`kubectl delete rljob x && kubectl apply -f x.yaml`: until the garbage collector removes the
    old job's Redis Secret, the new job waits (adopting it would give it a password that vanishes
    with the old job), then creates its own."""
    ops.apply(ns, tiny("again"))
    wait_for(lambda: ops.running(ns, "trainer", "again", 2), timeout=90, what="trainers")
    # A finalizer keeps the old Secret after the garbage collector deletes it, as a busy cluster
    # keeps it a while: the new job must find it there.
    hold = '{"metadata":{"finalizers":["e2e.rljob.dev/hold"]}}'
    ops.cluster.kubectl("patch", "secret", "again-redis", "-n", ns, "--type=merge", "-p", hold)
    ops.cluster.kubectl("delete", "rljob", "again", "-n", ns, "--wait=false")
    wait_for(lambda: not ops.rljob(ns, "again"), timeout=180, what="the old RLJob gone")
    ops.apply(ns, tiny("again"))
    uid = ops.rljob(ns, "again")["metadata"]["uid"]
    wait_for(
        lambda: ops.condition(ns, "again", "Ready").get("reason") == "SecretNotOwned",
        timeout=30,
        what="the new job waiting for the old Secret",
    )
    ops.cluster.kubectl(
        "patch", "secret", "again-redis", "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}'
    )

    def own_secret() -> bool:
        secret = ops.json("get", "secret", "again-redis", "-n", ns) or {}
        return [r["uid"] for r in secret.get("metadata", {}).get("ownerReferences", [])] == [uid]

    wait_for(own_secret, timeout=60, what="the new job's own Secret")
    ops.wait_phase(ns, "again", "Running", timeout=90)
    assert ops.json("get", "job", "again-trainer", "-n", ns)["metadata"]["ownerReferences"][0]["uid"] == uid
    time.sleep(3)  # and it stays: nothing deletes the Secret the job now uses
    assert own_secret()


def test_restart_limit_fails_the_job(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("limit", restartLimit=0))
    pods = wait_for(lambda: ops.running(ns, "trainer", "limit", 2), timeout=90, what="trainers")
    fail_pod(ops, ns, pods[1]["metadata"]["name"])
    ops.wait_phase(ns, "limit", "Failed", timeout=30)
    failed = ops.condition(ns, "limit", "Failed")
    assert failed["reason"] == "RestartLimitExceeded" and ops.status(ns, "limit")["restarts"] == 0
    wait_for(lambda: not ops.pods(ns, "rollout", "limit"), timeout=60, what="rollouts stopped")


def test_crashing_rollout_worker_is_replaced_without_touching_trainers(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("crash"))
    trainers = {p["metadata"]["uid"] for p in wait_for(lambda: ops.running(ns, "trainer", "crash", 2), timeout=90)}
    (rollout,) = wait_for(lambda: ops.running(ns, "rollout", "crash", 1), timeout=60)
    fail_pod(ops, ns, rollout["metadata"]["name"])
    wait_for(
        lambda: (r := ops.running(ns, "rollout", "crash", 1)) and r[0]["metadata"]["uid"] != rollout["metadata"]["uid"],
        timeout=60,
        what="replacement rollout worker",
    )
    assert {p["metadata"]["uid"] for p in ops.running(ns, "trainer", "crash", 2) or []} == trainers
    assert ops.status(ns, "crash")["restarts"] == 0


def test_trainer_completion_succeeds_the_job(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("done"))
    pods = wait_for(lambda: ops.running(ns, "trainer", "done", 2), timeout=90, what="trainers")
    for pod in pods:
        ops.cluster.kubectl(
            "patch",
            "pod",
            pod["metadata"]["name"],
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status":{"phase":"Succeeded"}}',
        )
    ops.wait_phase(ns, "done", "Succeeded", timeout=60)
    assert ops.condition(ns, "done", "Complete")["status"] == "True"
    assert ops.status(ns, "done").get("completionTime")
    wait_for(lambda: not ops.pods(ns, "rollout", "done"), timeout=60, what="rollouts stopped after success")
    # The table's ROLLOUTS follows the workers down after the job finished (it froze at "N/0").
    wait_for(lambda: ops.status(ns, "done").get("rollouts") == "0/0", timeout=30, what="ROLLOUTS 0/0")
    # TTL after finishing deletes the RLJob (and, through owner references, every child).
    ops.cluster.kubectl(
        "patch", "rljob", "done", "-n", ns, "--type=merge", "-p", '{"spec":{"ttlSecondsAfterFinished":1}}'
    )
    wait_for(lambda: not ops.rljob(ns, "done"), timeout=30, what="RLJob deleted by its TTL")


def test_spec_changes_roll_or_restart(ops: Ops, ns: str) -> None:
    ops.apply(ns, tiny("roll"))
    wait_for(lambda: ops.running(ns, "trainer", "roll", 2), timeout=90, what="trainers")
    job_uid = ops.json("get", "job", "roll-trainer", "-n", ns)["metadata"]["uid"]
    ops.cluster.kubectl(
        "patch",
        "rljob",
        "roll",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"rollout":{"minReplicas":2,"image":"ghcr.io/rljob/rljob-workers:0.1.1"}}}',
    )

    def rolled() -> bool:
        # Exactly 2 running workers, all on the new image: mid-roll, 2 running can still include
        # an old pod, and the next look can find 3 (the surge) or 1.
        pods = ops.running(ns, "rollout", "roll", 2)
        return bool(pods) and {p["spec"]["containers"][0]["image"] for p in pods} == {
            "ghcr.io/rljob/rljob-workers:0.1.1"
        }

    wait_for(rolled, timeout=90, what="2 rollout workers on the new image")
    assert ops.json("get", "job", "roll-trainer", "-n", ns)["metadata"]["uid"] == job_uid  # trainers untouched
    ops.cluster.kubectl("patch", "rljob", "roll", "-n", ns, "--type=merge", "-p", '{"spec":{"trainer":{"replicas":3}}}')
    wait_for(lambda: ops.running(ns, "trainer", "roll", 3), timeout=90, what="3 trainers after gang restart")
    assert ops.json("get", "job", "roll-trainer", "-n", ns)["metadata"]["uid"] != job_uid
    assert ops.status(ns, "roll")["restarts"] == 0  # a spec restart is not a failure


def test_delete_cascades(ops: Ops, ns: str) -> None:
    doc = tiny("gone")
    doc["spec"]["weightSync"]["redis"]["persistence"] = True  # a claim, which must go with the job too
    ops.apply(ns, doc)
    wait_for(lambda: ops.running(ns, "trainer", "gone", 2), timeout=90, what="trainers")
    claim = "data-gone-redis-0"
    wait_for(lambda: ops.json("get", "pvc", claim, "-n", ns), timeout=60, what="the Redis volume claim")
    # The operator's finalizer is released asynchronously; under a loaded CPU that can take a while.
    ops.cluster.kubectl("delete", "rljob", "gone", "-n", ns, "--wait=false")
    wait_for(
        lambda: ops.cluster.kubectl("get", "rljob", "gone", "-n", ns, check=False).returncode != 0,
        timeout=180,
        what="the RLJob to be deleted (finalizer released)",
    )
    wait_for(
        lambda: (
            not ops.children(ns, "gone") and not ops.pods(ns, "trainer", "gone") and not ops.pods(ns, "rollout", "gone")
        ),
        timeout=90,
        what="children garbage-collected",
    )
    wait_for(lambda: ops.json("get", "pvc", claim, "-n", ns) is None, timeout=90, what="the claim deleted")


def deny_rollouts_of(ops: Ops, ns: str, job: str) -> str:
    """An admission policy (as a cluster's own policies would) refusing that job's rollout
    Deployment in `ns`; returns its name. Waits until the API server enforces it."""
    name = f"deny-{ns}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["deployments"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": f"object.metadata.?labels[?'rljob.dev/job'].orValue('') != '{job}'",
                    "message": "rollout workers of this job are not allowed here (test policy)",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
        },
    }
    for doc in (policy, binding):
        ops.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    probe = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "probe", "namespace": ns, "labels": {"rljob.dev/job": job}},
        "spec": {
            "selector": {"matchLabels": {"app": "probe"}},
            "template": {
                "metadata": {"labels": {"app": "probe"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }

    def enforced() -> bool:
        out = ops.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe), check=False)
        return out.returncode != 0 and "not allowed here" in out.stderr

    wait_for(enforced, timeout=30, what="the admission policy enforced")
    return name


def test_a_child_the_api_server_refuses_builds_nothing_and_says_why(ops: Ops, ns: str) -> None:
    # A new job whose Deployment a cluster policy refuses: no child at all, Pending, and the
    # API server's words in Ready (and an event), instead of a half-built job.
    policy = deny_rollouts_of(ops, ns, "denied")
    ops.apply(ns, tiny("denied"))
    wait_for(
        lambda: ops.condition(ns, "denied", "Ready").get("reason") == "ApplyRejected", timeout=30, what="ApplyRejected"
    )
    ready = ops.condition(ns, "denied", "Ready")
    assert "Deployment denied-rollout" in ready["message"] and "not allowed here" in ready["message"]
    assert ops.status(ns, "denied")["phase"] == "Pending"
    time.sleep(2)
    assert ops.children(ns, "denied") == []
    reasons = ops.cluster.kubectl("get", "events", "-n", ns, "-o", "jsonpath={.items[*].reason}").stdout
    assert "ApplyRejected" in reasons
    ops.cluster.kubectl("delete", "validatingadmissionpolicybinding", policy)
    wait_for(lambda: ops.running(ns, "trainer", "denied", 2), timeout=90, what="built once the policy is gone")
    wait_for(
        lambda: ops.condition(ns, "denied", "Ready").get("reason") != "ApplyRejected",
        timeout=30,
        what="Ready no longer ApplyRejected",
    )

    # A running job whose update is refused: it keeps running on the previous spec, untouched
    # (the ConfigMap the workers read is not moved to the new spec either).
    ops.wait_phase(ns, "denied", "Running", timeout=30)
    config = ops.json("get", "configmap", "denied-config", "-n", ns)["data"]
    generation = ops.status(ns, "denied")["observedGeneration"]
    deny_rollouts_of(ops, ns, "denied")
    ops.cluster.kubectl(
        "patch", "rljob", "denied", "-n", ns, "--type=merge", "-p", '{"spec":{"rollout":{"minReplicas":2}}}'
    )
    wait_for(
        lambda: ops.condition(ns, "denied", "Ready").get("reason") == "ApplyRejected",
        timeout=30,
        what="the update refused",
    )
    status = ops.status(ns, "denied")
    assert status["phase"] == "Running" and status["observedGeneration"] == generation
    assert ops.json("get", "configmap", "denied-config", "-n", ns)["data"] == config
    assert len(ops.running(ns, "trainer", "denied", 2) or []) == 2
    ops.cluster.kubectl("delete", "validatingadmissionpolicybinding", policy)
    ops.cluster.kubectl("delete", "validatingadmissionpolicy", policy)
    wait_for(lambda: ops.running(ns, "rollout", "denied", 2), timeout=90, what="the update applied after all")
    assert ops.status(ns, "denied")["observedGeneration"] > generation


def test_a_trainer_the_api_server_refuses_builds_nothing_and_says_why(ops: Ops, ns: str) -> None:
    # A quota that allows no Jobs refuses the trainer Job: no child at all (no workers and Redis
    # for a gang that never starts), Pending, and the quota named in Ready, until it is removed.
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-jobs"},
        "spec": {"hard": {"count/jobs.batch": "0"}},
    }
    ops.apply(ns, quota)
    wait_for(
        lambda: ops.json("get", "resourcequota", "no-jobs", "-n", ns).get("status", {}).get("hard"),
        timeout=30,
        what="the quota counted",
    )
    ops.apply(ns, tiny("quota"))
    wait_for(
        lambda: ops.condition(ns, "quota", "Ready").get("reason") == "ApplyRejected", timeout=30, what="ApplyRejected"
    )
    message = ops.condition(ns, "quota", "Ready")["message"]
    assert "Job quota-trainer" in message and "no-jobs" in message, message
    assert ops.status(ns, "quota")["phase"] == "Pending"
    time.sleep(2)
    assert ops.children(ns, "quota") == []
    reasons = ops.cluster.kubectl("get", "events", "-n", ns, "-o", "jsonpath={.items[*].reason}").stdout
    assert "ApplyRejected" in reasons
    ops.cluster.kubectl("delete", "resourcequota", "no-jobs", "-n", ns)
    wait_for(lambda: ops.running(ns, "trainer", "quota", 2), timeout=90, what="built once the quota is gone")


def test_an_api_error_is_reported_on_the_job_and_counted(ops: Ops, ns: str) -> None:
    # A webhook that cannot be reached (failurePolicy Fail) makes the API server answer 500, not a
    # refusal: the pass raises (kopf retries it), and the RLJob says so, once as an event.
    webhook = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"down-{ns}"},
        "webhooks": [
            {
                "name": PROVOKED_ERROR,
                "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["configmaps"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "objectSelector": {"matchLabels": {"rljob.dev/job": "broken"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }
        ],
    }
    errors = ops.operator.metrics().get("rljob_operator_reconcile_errors_total", 0.0)
    ops.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(webhook))
    try:
        ops.apply(ns, tiny("broken"))
        wait_for(
            lambda: ops.condition(ns, "broken", "Ready").get("reason") == "ReconcileError",
            timeout=30,
            what="ReconcileError",
        )
        ready = ops.condition(ns, "broken", "Ready")
        assert ready["status"] == "False" and ready["message"].startswith("500 ") and PROVOKED_ERROR in ready["message"]
        assert ops.status(ns, "broken")["phase"] == "Pending"
        time.sleep(3)  # passes keep failing (timer every second): still one event
        events = ops.json("get", "events", "-n", ns, "--field-selector", "reason=ReconcileError")["items"]
        assert len(events) == 1 and sum(e.get("count", 1) for e in events) == 1, events
        metrics = ops.operator.metrics()
        assert metrics["rljob_operator_reconcile_errors_total"] >= errors + 2
    finally:
        ops.cluster.kubectl("delete", "validatingwebhookconfiguration", f"down-{ns}", check=False)
    # kopf retries a handler or timer that raised after its backoff (60 s).
    wait_for(lambda: ops.json("get", "configmap", "broken-config", "-n", ns), timeout=90, what="built after all")
    wait_for(
        lambda: time.time() - ops.operator.metrics()["rljob_operator_last_successful_reconcile_timestamp_seconds"] < 10,
        timeout=30,
        what="a successful pass in the metrics",
    )


GROUP_SIZE_MAXIMUM = (
    "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/grpo/properties/groupSize/maximum"
)


def patch_crd(ops: Ops, op: dict[str, Any]) -> None:
    ops.cluster.kubectl("patch", "crd", "rljobs.rljob.dev", "--type=json", "-p", json.dumps([op]))


def test_a_spec_an_older_crd_lets_through_is_reported_not_built(ops: Ops, ns: str) -> None:
    """The operator's model is the last word on a spec: where the installed CRD is looser (older
    than the operator), a running job keeps running on its last valid spec and says why in Ready;
    a new one fails as InvalidSpec with nothing built, and starts once its spec is fixed."""
    ops.apply(ns, tiny("loose"))
    wait_for(lambda: ops.running(ns, "trainer", "loose", 2), timeout=90, what="trainers")
    ops.wait_phase(ns, "loose", "Running", timeout=30)
    trainer_uid = ops.json("get", "job", "loose-trainer", "-n", ns)["metadata"]["uid"]
    config = ops.json("get", "configmap", "loose-config", "-n", ns)["data"]
    generation = ops.status(ns, "loose")["observedGeneration"]
    patch_crd(ops, {"op": "remove", "path": GROUP_SIZE_MAXIMUM})  # the model keeps groupSize <= 256
    try:
        too_big = '{"spec":{"grpo":{"groupSize":300}}}'
        wait_for(
            lambda: (
                ops.cluster.kubectl(
                    "patch", "rljob", "loose", "-n", ns, "--type=merge", "-p", too_big, check=False
                ).returncode
                == 0
            ),
            timeout=30,
            what="the looser CRD in effect",
        )
        wait_for(
            lambda: ops.condition(ns, "loose", "Ready").get("reason") == "InvalidSpec",
            timeout=30,
            what="InvalidSpec on the running job",
        )
        message = ops.condition(ns, "loose", "Ready")["message"]
        assert "groupSize" in message and "still running the previous spec" in message, message
        status = ops.status(ns, "loose")
        assert status["phase"] == "Running" and status["observedGeneration"] == generation
        assert ops.json("get", "job", "loose-trainer", "-n", ns)["metadata"]["uid"] == trainer_uid
        assert ops.json("get", "configmap", "loose-config", "-n", ns)["data"] == config
        assert len(ops.running(ns, "trainer", "loose", 2) or []) == 2

        ops.apply(ns, tiny("never", grpo={"groupSize": 300}))
        ops.wait_phase(ns, "never", "Failed", timeout=30)
        failed = ops.condition(ns, "never", "Failed")
        assert failed["reason"] == "InvalidSpec" and "groupSize" in failed["message"], failed
        time.sleep(2)
        assert ops.children(ns, "never") == []

        # Fixed specs: the running job takes it and Ready clears; the failed one starts over.
        ops.cluster.kubectl(
            "patch", "rljob", "loose", "-n", ns, "--type=merge", "-p", '{"spec":{"grpo":{"groupSize":4}}}'
        )
        wait_for(
            lambda: ops.condition(ns, "loose", "Ready").get("reason") != "InvalidSpec",
            timeout=30,
            what="Ready no longer InvalidSpec",
        )
        assert ops.status(ns, "loose")["observedGeneration"] > generation
        ops.cluster.kubectl(
            "patch", "rljob", "never", "-n", ns, "--type=merge", "-p", '{"spec":{"grpo":{"groupSize":4}}}'
        )
        wait_for(lambda: ops.running(ns, "trainer", "never", 2), timeout=90, what="the fixed job started")
        assert ops.status(ns, "never")["phase"] != "Failed"
    finally:
        # docs/operator.md's upgrade step (helm upgrade leaves CRDs alone): the chart's CRD over the old one.
        ops.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    wait_for(
        lambda: ops.apply(ns, tiny("after", grpo={"groupSize": 300}), check=False).returncode != 0,
        timeout=30,
        what="the chart's CRD in effect again",
    )
    refused = ops.apply(ns, tiny("after", grpo={"groupSize": 300}), check=False)
    assert "groupSize" in refused.stderr, refused.stderr


def test_keda_objects_are_paused_when_the_job_ends_and_removed_when_switched_off(ops: Ops, ns: str) -> None:
    # KEDA's real CRDs (from its pinned Go module, see e2e/cluster/build.sh), so the API server
    # validates what the operator writes; KEDA's controller does not run here, so nothing scales.
    crds = next(ops.cluster.bin_dir.glob("keda-crds-*.yaml"))
    ops.cluster.kubectl("apply", "--server-side", "-f", str(crds))
    try:
        # The operator re-checks discovery at most once a minute.
        ops.apply(ns, tiny("kdone", rollout={"autoscaler": "keda"}))
        ops.apply(ns, tiny("kswitch", rollout={"autoscaler": "keda"}))
        for job in ("kdone", "kswitch"):
            wait_for(
                lambda job=job: ops.json("get", "scaledobject", f"{job}-rollout", "-n", ns),
                timeout=120,
                what=f"{job}'s ScaledObject",
            )
        scaled = ops.json("get", "scaledobject", "kdone-rollout", "-n", ns)
        streams = [t["metadata"]["stream"] for t in scaled["spec"]["triggers"]]
        assert streams == [f"rljob:{{{ns}/kdone}}:prompts", f"rljob:{{{ns}/kdone}}:eval:prompts"]
        assert "autoscaling.keda.sh/paused-replicas" not in scaled["metadata"].get("annotations", {})

        # Finished: paused at zero, or KEDA's HPA would bring workers back to minReplicaCount.
        pods = wait_for(lambda: ops.running(ns, "trainer", "kdone", 2), timeout=90, what="trainers")
        for pod in pods:
            ops.cluster.kubectl(
                "patch",
                "pod",
                pod["metadata"]["name"],
                "-n",
                ns,
                "--subresource=status",
                "--type=merge",
                "-p",
                '{"status":{"phase":"Succeeded"}}',
            )
        ops.wait_phase(ns, "kdone", "Succeeded", timeout=60)

        def paused() -> bool:
            found = ops.json("get", "scaledobject", "kdone-rollout", "-n", ns) or {}
            return found.get("metadata", {}).get("annotations", {}).get("autoscaling.keda.sh/paused-replicas") == "0"

        wait_for(paused, timeout=60, what="the ScaledObject paused at 0 after success")

        # Switched to the operator's own autoscaler: KEDA's objects go, so only one writer of replicas.
        ops.cluster.kubectl(
            "patch",
            "rljob",
            "kswitch",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"rollout":{"autoscaler":"operator"}}}',
        )
        wait_for(
            lambda: (
                ops.json("get", "scaledobject", "kswitch-rollout", "-n", ns) is None
                and ops.json("get", "triggerauthentication", "kswitch-rollout", "-n", ns) is None
            ),
            timeout=60,
            what="KEDA objects deleted after switching autoscaler",
        )
        assert ops.json("get", "deployment", "kswitch-rollout", "-n", ns)["spec"]["replicas"] >= 1
    finally:
        ops.cluster.kubectl("delete", "-f", str(crds), "--wait=false", check=False)


def test_rbac_is_least_privilege(ops: Ops) -> None:
    user = f"--as=system:serviceaccount:{OP_NS}:{SA}"

    def can(verb: str, resource: str) -> bool:
        out = ops.cluster.kubectl("auth", "can-i", verb, resource, "-A", user, check=False).stdout.strip()
        return out == "yes"

    for verb, resource in [
        ("watch", "rljobs.rljob.dev"),
        ("patch", "rljobs.rljob.dev/status"),
        ("create", "jobs"),
        ("delete", "jobs"),
        ("create", "workloads.scheduling.k8s.io"),
        ("list", "pods"),
        ("create", "secrets"),
        ("create", "events"),
    ]:
        assert can(verb, resource), f"operator needs {verb} {resource}"
    for verb, resource in [
        ("list", "secrets"),
        ("delete", "secrets"),
        ("delete", "deployments"),
        ("delete", "pods"),
        ("watch", "pods"),
        ("create", "pods"),
        ("list", "customresourcedefinitions"),
        ("create", "clusterroles"),
        ("*", "*"),
        ("update", "rljobs.rljob.dev"),
    ]:
        assert not can(verb, resource), f"operator must not {verb} {resource}"
