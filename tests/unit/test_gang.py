"""Gang providers: each renders its gang object with min member = trainer replicas and ties pods to it."""

from __future__ import annotations

from rljob.config import RLJob
from rljob_operator.gang import WORKLOAD_ALPHA, referenced_workload
from rljob_operator.render import RenderPlan, render_children

PLAN = RenderPlan(uid="u", rollout_replicas=1)


def children(provider: str, plan: RenderPlan = PLAN, **trainer) -> list[dict]:
    job = RLJob.model_validate(
        {
            "metadata": {"name": "g", "namespace": "ns"},
            "spec": {"trainer": {"gangProvider": provider, "replicas": 3, **trainer}},
        }
    )
    return render_children(job, plan)


def trainer_pod(objs: list[dict]) -> dict:
    return next(c for c in objs if c["kind"] == "Job")["spec"]["template"]


def test_workload_api_beta_by_default() -> None:
    objs = children("workload")
    workload = next(c for c in objs if c["kind"] == "Workload")
    group = next(c for c in objs if c["kind"] == "PodGroup")
    assert workload["apiVersion"] == group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    (template,) = workload["spec"]["podGroupTemplates"]
    assert template["schedulingPolicy"] == {"gang": {"minCount": 3}}
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}
    assert group["spec"]["workloadRef"] == {"workloadName": "g-trainer", "templateName": template["name"]}
    assert referenced_workload(group) == "g-trainer"
    pod = trainer_pod(objs)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "g-trainer"}
    assert "schedulerName" not in pod["spec"]


def test_workload_api_alpha_where_the_cluster_serves_only_that() -> None:
    objs = children("workload", plan=RenderPlan(uid="u", rollout_replicas=1, workload_api=WORKLOAD_ALPHA))
    workload = next(c for c in objs if c["kind"] == "Workload")
    group = next(c for c in objs if c["kind"] == "PodGroup")
    assert workload["apiVersion"] == group["apiVersion"] == "scheduling.k8s.io/v1alpha2"
    assert "workloadRef" not in group["spec"]
    assert group["spec"]["podGroupTemplateRef"] == {
        "workload": {
            "workloadName": "g-trainer",
            "podGroupTemplateName": workload["spec"]["podGroupTemplates"][0]["name"],
        }
    }
    assert referenced_workload(group) == "g-trainer"
    assert trainer_pod(objs)["spec"]["schedulingGroup"] == {"podGroupName": "g-trainer"}


def test_volcano() -> None:
    objs = children("volcano", resources={"gpus": 1, "cpu": "500m"})
    group = next(c for c in objs if c["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"]["minMember"] == 3
    assert group["spec"]["minResources"] == {"cpu": "1500m", "nvidia.com/gpu": "3"}
    pod = trainer_pod(objs)
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "g-trainer"
    assert pod["spec"]["schedulerName"] == "volcano"


def test_coscheduling() -> None:
    objs = children("coscheduling", scheduleTimeoutSeconds=120, schedulerName="my-sched")
    group = next(c for c in objs if c["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"]["minMember"] == 3 and group["spec"]["scheduleTimeoutSeconds"] == 120
    pod = trainer_pod(objs)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "g-trainer"
    assert pod["spec"]["schedulerName"] == "my-sched"


def test_none_has_no_gang_object_but_still_one_indexed_job() -> None:
    objs = children("none")
    assert not [c for c in objs if c["kind"] in ("Workload", "PodGroup")]
    job = next(c for c in objs if c["kind"] == "Job")
    assert job["spec"]["parallelism"] == 3 and job["spec"]["backoffLimit"] == 0
    assert "schedulingGroup" not in job["spec"]["template"]["spec"]
