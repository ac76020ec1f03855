"""Gang providers: how the trainer pods are made to start all together or not at all.

Each provider renders its gang object(s) and the fields the trainer pod template needs to join
the gang. With `none` there is no gang scheduler; the operator then relies on the indexed Job
creating all members at once, on torch.distributed's rendezvous (no rank trains before all
WORLD_SIZE members joined), and on its own timer: a gang not fully Running within
`trainer.scheduleTimeoutSeconds` is torn down whole (freeing what it holds) and counted as a
restart, so a partial gang never trains and never holds GPUs forever.
"""

from __future__ import annotations

from typing import Any

from rljob.config import RLJob
from rljob_operator.names import ChildNames

WORKLOAD_BETA = "scheduling.k8s.io/v1beta1"  # Kubernetes 1.37
WORKLOAD_ALPHA = "scheduling.k8s.io/v1alpha2"  # Kubernetes 1.36 (1.35's v1alpha1 is not supported)
# Kubernetes' own Workload API, newest first: the operator renders the first the cluster serves.
WORKLOAD_APIS = (WORKLOAD_BETA, WORKLOAD_ALPHA)
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
GANG_TEMPLATE = "trainers"

DEFAULT_SCHEDULERS = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}
# The API group/versions each provider can use, one of which the cluster must serve (checked
# before anything is created).
PROVIDER_APIS = {"workload": WORKLOAD_APIS, "volcano": (VOLCANO_API,), "coscheduling": (COSCHEDULING_API,)}
# Every gang object any provider renders (all named `<job>-trainer`): deleting a gang removes them
# all, so switching `trainer.gangProvider` leaves none of the previous provider's behind.
GANG_KINDS = (
    *((api, kind) for api in WORKLOAD_APIS for kind in ("Workload", "PodGroup")),
    (VOLCANO_API, "PodGroup"),
    (COSCHEDULING_API, "PodGroup"),
)


def _min_resources(job: RLJob) -> dict[str, str]:
    res = job.spec.trainer.resources
    n = job.spec.trainer.replicas
    millis = int(float(res.cpu[:-1])) if res.cpu.endswith("m") else int(float(res.cpu) * 1000)
    out = {"cpu": f"{millis * n}m"}
    if res.gpus:
        out["nvidia.com/gpu"] = str(res.gpus * n)
    return out


def render_gang_objects(job: RLJob, workload_api: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The gang object(s) for the trainer (min member = trainer replicas), all with `meta`; none for
    `none`. `workload_api` is the Workload API version the cluster serves (one of WORKLOAD_APIS)."""
    spec = job.spec.trainer
    trainer = ChildNames(job.metadata.name, job.metadata.namespace).trainer
    n = spec.replicas
    if spec.gang_provider == "workload":
        gang = {"gang": {"minCount": n}}
        workload = {
            "apiVersion": workload_api,
            "kind": "Workload",
            "metadata": meta,
            "spec": {
                "controllerRef": {"apiGroup": "batch", "kind": "Job", "name": trainer},
                "podGroupTemplates": [{"name": GANG_TEMPLATE, "schedulingPolicy": gang}],
            },
        }
        pod_group = {
            "apiVersion": workload_api,
            "kind": "PodGroup",
            "metadata": meta,
            "spec": {**workload_reference(workload_api, trainer), "schedulingPolicy": gang},
        }
        return [workload, pod_group]
    if spec.gang_provider == "none":
        return []
    group: dict[str, Any] = {"minMember": n, "minResources": _min_resources(job)}
    if spec.gang_provider == "coscheduling":
        group["scheduleTimeoutSeconds"] = spec.schedule_timeout_seconds
    api = PROVIDER_APIS[spec.gang_provider][0]  # volcano's or coscheduling's PodGroup
    return [{"apiVersion": api, "kind": "PodGroup", "metadata": meta, "spec": group}]


def workload_reference(workload_api: str, workload: str) -> dict[str, Any]:
    """How a PodGroup names its Workload's template: the one field the two versions spell apart."""
    if workload_api == WORKLOAD_ALPHA:
        return {"podGroupTemplateRef": {"workload": {"workloadName": workload, "podGroupTemplateName": GANG_TEMPLATE}}}
    return {"workloadRef": {"workloadName": workload, "templateName": GANG_TEMPLATE}}


def referenced_workload(pod_group: dict[str, Any]) -> str | None:
    """The Workload a rendered PodGroup names, in either version's spelling."""
    spec = pod_group.get("spec", {})
    if "workloadRef" in spec:
        return spec["workloadRef"].get("workloadName")
    return spec.get("podGroupTemplateRef", {}).get("workload", {}).get("workloadName")


def join_gang(job: RLJob, template_meta: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """Add the labels, annotations and pod-spec fields that tie a trainer pod template to its gang."""
    spec = job.spec.trainer
    group = ChildNames(job.metadata.name, job.metadata.namespace).trainer
    scheduler = spec.scheduler_name or DEFAULT_SCHEDULERS.get(spec.gang_provider)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    if spec.gang_provider == "workload":
        pod_spec["schedulingGroup"] = {"podGroupName": group}
    elif spec.gang_provider == "volcano":
        template_meta["annotations"]["scheduling.k8s.io/group-name"] = group
    elif spec.gang_provider == "coscheduling":
        template_meta["labels"]["scheduling.x-k8s.io/pod-group"] = group
