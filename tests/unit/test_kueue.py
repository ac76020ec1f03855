"""Kueue (`spec.queueName`): what the children carry, and what the status says while the gang waits."""

from __future__ import annotations

from typing import Any

from rljob.config import RLJob
from rljob_operator.api import RLJobStatus
from rljob_operator.decide import Observed, decide_trainer, iso
from rljob_operator.kueue import QUEUE_LABEL, queued, quota_reservation
from rljob_operator.names import ANNOTATION_TRAINER_HASH
from rljob_operator.render import RenderPlan, render_children, trainer_hash
from rljob_operator.status import compute_status

NOW = 1_800_000_000.0
PLAN = RenderPlan(uid="u", rollout_replicas=1)
WAITING = {
    "type": "QuotaReserved",
    "status": "False",
    "reason": "Pending",
    "message": "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor "
    "default, 8 more needed",
}
NEVER = {
    **WAITING,
    "message": "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor default, "
    "previously considered podsets requests (0) + current podset request (16) > maximum capacity (8)",
}


def make(**spec: Any) -> RLJob:
    return RLJob.model_validate({"metadata": {"name": "j", "namespace": "ns"}, "spec": spec})


def kind(children: list[dict], name: str) -> dict:
    return next(c for c in children if c["kind"] == name)


def trainer_job(job: RLJob, suspended: bool) -> dict[str, Any]:
    return {
        "metadata": {
            "uid": "job-uid",
            "name": "j-trainer",
            "annotations": {ANNOTATION_TRAINER_HASH: trainer_hash(job)},
        },
        "spec": {"suspend": suspended},
        "status": {"startTime": iso(NOW - 900)} if not suspended else {},
    }


def test_a_queued_job_labels_its_gang_and_rollout_pool_and_leaves_suspend_to_kueue() -> None:
    children = render_children(make(queueName="team"), PLAN)
    trainer, rollout = kind(children, "Job"), kind(children, "Deployment")
    assert trainer["metadata"]["labels"][QUEUE_LABEL] == "team"
    assert "suspend" not in trainer["spec"]  # Kueue's webhook suspends it; admission unsuspends it
    assert rollout["metadata"]["labels"][QUEUE_LABEL] == "team"
    assert rollout["spec"]["template"]["metadata"]["labels"][QUEUE_LABEL] == "team"
    redis = kind(children, "StatefulSet")
    assert QUEUE_LABEL not in redis["metadata"]["labels"]  # the job's Redis is not queued
    assert QUEUE_LABEL not in redis["spec"]["template"]["metadata"]["labels"]


def test_a_job_without_a_queue_is_not_handed_to_kueue() -> None:
    children = render_children(make(), PLAN)
    assert all(QUEUE_LABEL not in c["metadata"].get("labels", {}) for c in children)
    assert kind(children, "Job")["spec"]["suspend"] is False


def test_queued_says_why_the_gang_waits_and_when_it_never_can_start() -> None:
    job = make(queueName="team")
    assert queued(job, trainer_job(job, suspended=False), None) is None  # admitted
    assert queued(job, None, None) is None  # nothing submitted yet
    assert queued(make(), trainer_job(job, suspended=True), WAITING) is None  # not queued at all
    assert queued(job, trainer_job(job, suspended=True), None) == (
        "Queued",
        "waiting for Kueue to admit the trainer gang (LocalQueue team)",
    )
    reason, message = queued(job, trainer_job(job, suspended=True), WAITING)
    assert reason == "Queued" and "LocalQueue team" in message and "8 more needed" in message
    reason, message = queued(job, trainer_job(job, suspended=True), NEVER)
    assert reason == "QuotaExceedsQueue" and "can never fit" in message and "maximum capacity (8)" in message


def test_quota_reservation_reads_the_workload_condition() -> None:
    assert quota_reservation(None) is None
    assert quota_reservation({"status": {"conditions": [{"type": "PodsReady"}]}}) is None
    assert quota_reservation({"status": {"conditions": [WAITING]}}) == WAITING


def test_the_status_of_a_waiting_gang_is_queued_with_kueues_reason() -> None:
    job = make(queueName="team")
    obs = Observed(trainer_job=trainer_job(job, suspended=True), quota_reservation=NEVER)
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, lambda _: 0)
    assert decision.action == "apply"  # a suspended Job in a queue is neither failed nor timed out
    st = compute_status(job, 1, RLJobStatus(), obs, decision, 1, None, None, NOW)
    assert st.phase == "Queued"
    trainers = next(c for c in st.conditions if c.type == "TrainersReady")
    assert (trainers.status, trainers.reason) == ("False", "QuotaExceedsQueue")
    assert "maximum capacity (8)" in trainers.message


def test_once_admitted_the_gang_is_judged_as_any_other() -> None:
    job = make(queueName="team")
    obs = Observed(trainer_job=trainer_job(job, suspended=False))
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, lambda _: 0)
    st = compute_status(job, 1, RLJobStatus(), obs, decision, 1, None, None, NOW)
    assert st.phase == "Pending"  # admitted, its pods not bound yet (kwok binds them next)


def test_suspending_a_queued_job_deletes_its_gang_and_queues_none() -> None:
    job = make(queueName="team", suspend=True)
    found = decide_trainer(job, RLJobStatus(), Observed(trainer_job=trainer_job(job, False)), NOW, lambda _: 0)
    assert (found.action, found.reason) == ("delete", "Suspended")
    assert found.failed_uid is None  # not counted as a restart
    none = decide_trainer(job, RLJobStatus(), Observed(), NOW, lambda _: 0)
    assert (none.action, none.reason) == ("wait", "Suspended")
    st = compute_status(job, 1, RLJobStatus(), Observed(), none, 0, None, None, NOW)
    assert st.phase == "Suspended"


class Discovery:
    """Only the API server's discovery answers, for the preflight checks (the rest of the
    Reconciler's Kube is never called here); e2e/test_kueue.py runs them against a real one."""

    def __init__(self, served: set[str]) -> None:
        self.served = served

    def api_available(self, api_version: str) -> bool:
        return api_version in self.served


def preflight(served: set[str], **spec: Any) -> tuple[str | None, str]:
    import logging

    from rljob_operator.reconcile import Reconciler
    from rljob_operator.settings import OperatorSettings

    settings = OperatorSettings("rljob-system", "keda", 1.0, 1.0, 10.0, redis_timeout_seconds=0.5, metrics_port=0)
    reconciler = Reconciler(
        kube=Discovery(served), settings=settings, post_event=lambda *a: None, log=logging.getLogger("t")
    )  # type: ignore[arg-type]
    return reconciler._preflight(make(**spec))


def test_a_queued_job_on_a_cluster_without_kueue_fails_before_anything_is_built() -> None:
    beta = {"scheduling.k8s.io/v1beta1"}
    reason, message = preflight(beta, queueName="team")
    assert reason == "KueueUnavailable" and "kueue.x-k8s.io/v1beta2" in message
    assert preflight(beta) == (None, "")
    assert preflight(beta | {"kueue.x-k8s.io/v1beta1"}, queueName="team") == (None, "")  # an older Kueue
