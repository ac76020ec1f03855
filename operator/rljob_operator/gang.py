"""Gang providers: how the trainer pods are made to start all together or not at all.

Each provider renders its gang object(s) and the fields the trainer pod template needs to join
the gang. With `none` there is no gang scheduler; the operator then relies on the indexed Job
creating all members at once, on torch.distributed's rendezvous (no rank trains before all
WORLD_SIZE members joined), and on its own timer: a gang not fully Running within
`trainer.scheduleTimeoutSeconds` is torn down whole (freeing what it holds) and counted as a
restart, so a partial gang never trains and never holds GPUs forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob.config import RLJob
from rljob_operator.names import ChildNames, labels

WORKLOAD_API = "scheduling.k8s.io/v1alpha2"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
GANG_TEMPLATE = "trainers"

DEFAULT_SCHEDULERS = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}
# The API group/version each provider needs on the cluster (checked before anything is created).
PROVIDER_APIS = {"workload": WORKLOAD_API, "volcano": VOLCANO_API, "coscheduling": COSCHEDULING_API}
# Every gang object any provider renders (all named `<job>-trainer`): deleting a gang removes them
# all, so switching `trainer.gangProvider` leaves none of the previous provider's behind.
GANG_KINDS = ((WORKLOAD_API, "Workload"), (WORKLOAD_API, "PodGroup"), (VOLCANO_API, "PodGroup"),
              (COSCHEDULING_API, "PodGroup"))  # fmt: skip


@dataclass
class PodGangFields:
    """What a trainer pod template needs to belong to the gang."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)


def _min_resources(job: RLJob) -> dict[str, str]:
    res = job.spec.trainer.resources
    n = job.spec.trainer.replicas
    out = {"cpu": f"{_cpu_millis(res.cpu) * n}m"}
    if res.gpus:
        out["nvidia.com/gpu"] = str(res.gpus * n)
    return out


def _cpu_millis(cpu: str) -> int:
    return int(float(cpu[:-1])) if cpu.endswith("m") else int(float(cpu) * 1000)


def render_gang_objects(job: RLJob) -> list[dict[str, Any]]:
    """The gang object(s) for the trainer (min member = trainer replicas); none for `none`."""
    spec = job.spec.trainer
    names = ChildNames(job.metadata.name, job.metadata.namespace)
    meta = {"name": names.trainer, "namespace": names.namespace, "labels": labels(names.job, "trainer")}
    n = spec.replicas
    if spec.gang_provider == "workload":
        gang = {"gang": {"minCount": n}}
        workload = {
            "apiVersion": WORKLOAD_API,
            "kind": "Workload",
            "metadata": meta,
            "spec": {
                "controllerRef": {"apiGroup": "batch", "kind": "Job", "name": names.trainer},
                "podGroupTemplates": [{"name": GANG_TEMPLATE, "schedulingPolicy": gang}],
            },
        }
        pod_group = {
            "apiVersion": WORKLOAD_API,
            "kind": "PodGroup",
            "metadata": meta,
            "spec": {
                "podGroupTemplateRef": {
                    "workload": {"workloadName": names.trainer, "podGroupTemplateName": GANG_TEMPLATE}
                },
                "schedulingPolicy": gang,
            },
        }
        return [workload, pod_group]
    if spec.gang_provider == "volcano":
        return [
            {
                "apiVersion": VOLCANO_API,
                "kind": "PodGroup",
                "metadata": meta,
                "spec": {"minMember": n, "minResources": _min_resources(job)},
            }
        ]
    if spec.gang_provider == "coscheduling":
        return [
            {
                "apiVersion": COSCHEDULING_API,
                "kind": "PodGroup",
                "metadata": meta,
                "spec": {
                    "minMember": n,
                    "minResources": _min_resources(job),
                    "scheduleTimeoutSeconds": spec.schedule_timeout_seconds,
                },
            }
        ]
    return []


def pod_gang_fields(job: RLJob) -> PodGangFields:
    """Labels, annotations and pod-spec fields that tie a trainer pod to its gang."""
    spec = job.spec.trainer
    group = ChildNames(job.metadata.name, job.metadata.namespace).trainer
    fields = PodGangFields()
    scheduler = spec.scheduler_name or DEFAULT_SCHEDULERS.get(spec.gang_provider)
    if scheduler:
        fields.spec["schedulerName"] = scheduler
    if spec.gang_provider == "workload":
        fields.spec["schedulingGroup"] = {"podGroupName": group}
    elif spec.gang_provider == "volcano":
        fields.annotations["scheduling.k8s.io/group-name"] = group
    elif spec.gang_provider == "coscheduling":
        fields.labels["scheduling.x-k8s.io/pod-group"] = group
    return fields
