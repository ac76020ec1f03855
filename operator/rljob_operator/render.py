"""Pure rendering: RLJob spec in, Kubernetes manifests out. Handlers only apply what this returns.

Nothing here talks to the API server or reads the clock, so every manifest is unit-tested and
applying them twice is a no-op (server-side apply with stable names).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import yaml

from rljob.config import API_GROUP, API_VERSION, KIND, RLJob
from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.runtime_env import WorkerEnv
from rljob_operator.gang import WORKLOAD_BETA, join_gang, render_gang_objects
from rljob_operator.kueue import queue_labels
from rljob_operator.names import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_TRAINER_HASH,
    LABEL_JOB,
    REDIS_PORT,
    TRAINER_PORT,
    ChildNames,
    labels,
    selector,
)

Manifest = dict[str, Any]
CONFIG_DIR = "/etc/rljob"
CONFIG_PATH = f"{CONFIG_DIR}/job.yaml"
CHECKPOINT_DIR = "/checkpoints"
WORKER_UID = 1000
REDIS_UID = 999
KEDA_API = "keda.sh/v1alpha1"
KEDA_PAUSED = "autoscaling.keda.sh/paused-replicas"
# Parts of the spec each role reads: a change there rolls that role, a change elsewhere does not.
TRAINER_INPUTS = ("model", "data", "agent", "grpo", "warmup", "trainer", "weightSync", "eval")
ROLLOUT_INPUTS = ("model", "data", "agent", "rollout", "weightSync")
ROLLOUT_SCALING = ("minReplicas", "maxReplicas", "pendingPerReplica", "scaleDownCooldownSeconds", "autoscaler")


@dataclass(frozen=True)
class RenderPlan:
    """Decisions the operator made from observed state, passed in so rendering stays pure."""

    uid: str
    rollout_replicas: int
    trainers_suspended: bool = False
    operator_namespace: str = "rljob-system"
    keda_namespace: str = "keda"
    workload_api: str = WORKLOAD_BETA  # the Workload API version discovery found served


def owner_reference(job: RLJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(job: RLJob, name: str, role: str, uid: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": labels(job.metadata.name, role),
        "ownerReferences": [owner_reference(job, uid)],
        **extra,
    }


def spec_dict(job: RLJob) -> dict[str, Any]:
    return job.spec.model_dump(by_alias=True, mode="json", exclude_none=True)


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def trainer_hash(job: RLJob) -> str:
    """Changes to these inputs need a gang restart (trainers read the config once, at start)."""
    spec = spec_dict(job)
    return digest({k: spec.get(k) for k in TRAINER_INPUTS})


def rollout_hash(job: RLJob) -> str:
    spec = spec_dict(job)
    picked = {k: spec.get(k) for k in ROLLOUT_INPUTS}
    picked["rollout"] = {k: v for k, v in picked["rollout"].items() if k not in ROLLOUT_SCALING}
    return digest(picked)


def render_config_map(job: RLJob, plan: RenderPlan) -> Manifest:
    """The job's manifest, defaults filled in, as the workers read it back (`rljob.config.load_rljob`)."""
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    doc = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace},
        "spec": spec_dict(job),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, names.config, "config", plan.uid),
        "data": {"job.yaml": yaml.safe_dump(doc, sort_keys=False)},
    }


def render_redis_secret(job: RLJob, plan: RenderPlan, password: str) -> Manifest:
    """Created once (never re-applied) so the password stays stable for the job's life."""
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, names.redis_secret, "redis", plan.uid),
        "type": "Opaque",
        "stringData": {"password": password},
    }


def quantity_bytes(quantity: str) -> int:
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti)?", quantity)
    if not match:
        raise ValueError(f"not a binary quantity: {quantity!r}")
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _container_security(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security(uid: int) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": uid, "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}}


def _secret_env(name: str, secret: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}


def redis_url(job: RLJob) -> str:
    external = job.spec.weight_sync.redis.external_url
    return external or ChildNames(job.metadata.name, job.metadata.namespace).managed_redis_url


def redis_password_secret(job: RLJob) -> str:
    redis = job.spec.weight_sync.redis
    if redis.external_url:
        assert redis.password_secret, "validated by the model and the CRD"
        return redis.password_secret
    return ChildNames(job.metadata.name, job.metadata.namespace).redis_secret


def render_redis_service(job: RLJob, plan: RenderPlan) -> Manifest:
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, names.redis, "redis", plan.uid),
        "spec": {
            "selector": selector(names.job, "redis"),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}],
        },
    }


def render_redis_statefulset(job: RLJob, plan: RenderPlan) -> Manifest:
    """One Redis with AOF, a memory cap below its limit, and the password from the Secret.

    The password reaches redis-server through a config on stdin, so it is neither in the
    manifest nor in the process arguments.
    """
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    spec = job.spec.weight_sync.redis
    limit = quantity_bytes(spec.memory)
    maxmemory = int(limit * 0.8)  # headroom for the AOF rewrite fork and client buffers
    script = (
        f"exec redis-server - --port {REDIS_PORT} --dir /data "
        f"--appendonly {'yes' if spec.persistence else 'no'} --appendfsync everysec "
        f"--maxmemory {maxmemory} --maxmemory-policy noeviction --protected-mode no <<EOF\n"
        'requirepass "$REDIS_PASSWORD"\nEOF\n'
    )
    container = {
        "name": "redis",
        "image": spec.image,
        "command": ["sh", "-c", script],
        "env": [_secret_env("REDIS_PASSWORD", names.redis_secret), _secret_env("REDISCLI_AUTH", names.redis_secret)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": {
            "requests": {"cpu": "250m", "memory": spec.memory},
            "limits": {"memory": spec.memory},
        },
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "initialDelaySeconds": 10, "periodSeconds": 10},
        "securityContext": _container_security(REDIS_UID),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security(REDIS_UID),
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    sts_spec: dict[str, Any] = {
        "replicas": 1,
        "serviceName": names.redis,
        "selector": {"matchLabels": selector(names.job, "redis")},
        "template": {"metadata": {"labels": labels(names.job, "redis")}, "spec": pod_spec},
    }
    if spec.persistence:
        # Claims made from a template get no owner reference of their own: without this policy the
        # volume (and its append-only file, which a new job of the same name would load) outlives
        # the RLJob. Scaling is never done to this StatefulSet, so keep claims then.
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
        sts_spec["volumeClaimTemplates"] = [
            {
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": spec.storage}}},
            }
        ]
    else:
        pod_spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(job, names.redis, "redis", plan.uid),
        "spec": sts_spec,
    }


def render_redis_network_policy(job: RLJob, plan: RenderPlan) -> Manifest:
    """Only this job's pods, the operator (status) and KEDA (when it scales) may reach Redis."""
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    peers: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {LABEL_JOB: names.job}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": plan.operator_namespace}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rljob-operator"}},
        },
    ]
    if job.spec.rollout.autoscaler == "keda":
        peers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": plan.keda_namespace}}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, names.redis, "redis", plan.uid),
        "spec": {
            "podSelector": {"matchLabels": selector(names.job, "redis")},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
        },
    }


def _worker_pod_spec(job: RLJob, role: str, command: list[str], extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    role_spec = job.spec.trainer if role == "trainer" else job.spec.rollout
    res = role_spec.resources
    amounts: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    if res.gpus:
        amounts["nvidia.com/gpu"] = str(res.gpus)
    env = [
        {"name": WorkerEnv.NAMES["config_path"], "value": CONFIG_PATH},
        {"name": WorkerEnv.NAMES["redis_url"], "value": redis_url(job)},
        _secret_env(WorkerEnv.NAMES["redis_password"], redis_password_secret(job)),
        {"name": WorkerEnv.NAMES["checkpoint_dir"], "value": CHECKPOINT_DIR},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        *extra_env,
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    claim = job.spec.trainer.checkpoint_volume_claim if role == "trainer" else None
    checkpoints = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "checkpoints", **checkpoints},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    if data_claim := job.spec.data.volume_claim:
        mounts.append({"name": "data", "mountPath": "/data", "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": data_claim, "readOnly": True}})
    container = {
        "name": role,
        "image": role_spec.image,
        "command": ["rljob", *command],
        "env": env,
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "securityContext": _container_security(WORKER_UID),
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "securityContext": _pod_security(WORKER_UID),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    if res.gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def render_rollout_deployment(job: RLJob, plan: RenderPlan) -> Manifest:
    """Rollout workers; `replicas` is left to KEDA's HPA when KEDA scales."""
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    pod_spec = _worker_pod_spec(job, "rollout", ["rollout"], [])
    pod_spec["terminationGracePeriodSeconds"] = 60  # let a busy worker finish its batch
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(names.job, "rollout")},
        # No surge: a new worker must not need GPUs beyond what the job asked for.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        "template": {
            "metadata": {
                # The queue's label on the pods too, as Kueue's webhook would put it there.
                "labels": {**labels(names.job, "rollout"), **queue_labels(job)},
                "annotations": {ANNOTATION_CONFIG_HASH: rollout_hash(job)},
            },
            "spec": pod_spec,
        },
    }
    if job.spec.rollout.autoscaler == "operator" or plan.rollout_replicas == 0:
        spec["replicas"] = plan.rollout_replicas
    meta = _meta(job, names.rollout, "rollout", plan.uid)
    meta["labels"].update(queue_labels(job))
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def render_trainer_service(job: RLJob, plan: RenderPlan) -> Manifest:
    """Headless Service giving each trainer a stable DNS name for torch.distributed's rendezvous."""
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, names.trainer, "trainer", plan.uid),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rank 0 must resolve before it is Ready
            "selector": selector(names.job, "trainer"),
            "ports": [{"name": "dist", "port": TRAINER_PORT, "targetPort": TRAINER_PORT}],
        },
    }


def render_trainer_job(job: RLJob, plan: RenderPlan) -> Manifest:
    """The trainer gang as an indexed Job: stable hostnames <name>-trainer-<rank>, RANK = index.

    `backoffLimit: 0`: the Job controller never replaces a single member. A failure fails the
    Job and the operator restarts the whole gang (counted in the RLJob status).
    """
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    n = job.spec.trainer.replicas
    dist_env = [
        {"name": "MASTER_ADDR", "value": names.master_addr},
        {"name": "MASTER_PORT", "value": str(TRAINER_PORT)},
        {"name": "WORLD_SIZE", "value": str(n)},
        {
            "name": "RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
    ]
    pod_spec = _worker_pod_spec(job, "trainer", ["train"], dist_env)
    pod_spec["containers"][0]["ports"] = [{"name": "dist", "containerPort": TRAINER_PORT}]
    pod_spec.update({"restartPolicy": "Never", "subdomain": names.trainer})
    th = trainer_hash(job)
    template_meta = {"labels": labels(names.job, "trainer"), "annotations": {ANNOTATION_TRAINER_HASH: th}}
    join_gang(job, template_meta, pod_spec)
    meta = _meta(job, names.trainer, "trainer", plan.uid, annotations={ANNOTATION_TRAINER_HASH: th})
    meta["labels"].update(queue_labels(job))
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": n,
        "parallelism": n,
        "backoffLimit": 0,
        "podReplacementPolicy": "Failed",
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    if not job.spec.queue_name:  # a queued Job's suspend is Kueue's (rljob_operator/kueue.py)
        spec["suspend"] = plan.trainers_suspended
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def render_keda(job: RLJob, plan: RenderPlan) -> list[Manifest]:
    """A KEDA ScaledObject on the prompt stream's consumer-group lag, and its auth from the Secret."""
    if job.spec.rollout.autoscaler != "keda":
        return []
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    url = urlparse(redis_url(job))
    rollout = job.spec.rollout
    keys = JobKeys(names.namespace, names.job)

    def trigger(stream: str) -> dict[str, Any]:
        return {
            "type": "redis-streams",
            "metadata": {
                "address": f"{url.hostname}:{url.port or REDIS_PORT}",
                "stream": stream,
                "consumerGroup": ROLLOUT_GROUP,
                "lagCount": str(rollout.pending_per_replica),
                "activationLagCount": "0",
                "databaseIndex": (url.path.strip("/") or "0"),
                "enableTLS": "true" if url.scheme == "rediss" else "false",
            },
            "authenticationRef": {"name": names.rollout},
        }

    auth = {
        "apiVersion": KEDA_API,
        "kind": "TriggerAuthentication",
        "metadata": _meta(job, names.rollout, "rollout", plan.uid),
        "spec": {"secretTargetRef": [{"parameter": "password", "name": redis_password_secret(job), "key": "password"}]},
    }
    annotations = {KEDA_PAUSED: "0"} if plan.rollout_replicas == 0 else {}
    scaled = {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": _meta(job, names.rollout, "rollout", plan.uid, annotations=annotations),
        "spec": {
            "scaleTargetRef": {"name": names.rollout},
            "minReplicaCount": rollout.min_replicas,
            "maxReplicaCount": rollout.max_replicas,
            "cooldownPeriod": rollout.scale_down_cooldown_seconds,
            "pollingInterval": 10,
            # Workers serve both streams (evaluation prompts first); KEDA takes the larger demand.
            "triggers": [trigger(keys.prompts), trigger(keys.eval_prompts)],
        },
    }
    return [auth, scaled]


def render_children(job: RLJob, plan: RenderPlan) -> list[Manifest]:
    """Every child the operator applies on each reconcile, in dependency order.

    The Redis Secret is not here: it is created once with a fresh password (`render_redis_secret`).
    The trainer Job is last so it starts only once what it reads exists.
    """
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    out: list[Manifest] = [render_config_map(job, plan)]
    if not job.spec.weight_sync.redis.external_url:
        out += [
            render_redis_service(job, plan),
            render_redis_statefulset(job, plan),
            render_redis_network_policy(job, plan),
        ]
    out += [render_rollout_deployment(job, plan), *render_keda(job, plan), render_trainer_service(job, plan)]
    gang = render_gang_objects(job, plan.workload_api, _meta(job, names.trainer, "trainer", plan.uid))
    out += [*gang, render_trainer_job(job, plan)]
    return out
