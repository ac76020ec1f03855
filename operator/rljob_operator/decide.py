"""Pure decisions of a pass: what to do with the trainer gang (apply, wait, restart, delete, fail),
what a failed preflight check does, and when rollouts are forced off. No API calls and no clock
reads here; the reconciler passes what it observed and `now`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from rljob.config import RLJob
from rljob_operator.api import RLJobStatus
from rljob_operator.names import ANNOTATION_TRAINER_HASH
from rljob_operator.render import trainer_hash

TERMINAL = ("Succeeded", "Failed")
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"

Action = Literal["apply", "wait", "restart", "delete", "fail", "succeeded", "none"]


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@dataclass
class Observed:
    """What the operator read from the API server in this pass."""

    trainer_job: dict[str, Any] | None = None
    trainer_pods: list[dict[str, Any]] = field(default_factory=list)
    rollout: dict[str, Any] | None = None
    redis: dict[str, Any] | None = None
    external_redis: bool = False
    preflight_reason: str | None = None
    preflight_message: str = ""
    quota_reservation: dict[str, Any] | None = None  # Kueue's QuotaReserved on the trainer's Workload


@dataclass(frozen=True)
class TrainerDecision:
    action: Action
    reason: str = ""
    message: str = ""
    failed_uid: str | None = None  # set when this pass counts a gang failure


def _job_condition(job: dict[str, Any], *types: str) -> dict[str, Any] | None:
    for cond in job.get("status", {}).get("conditions", []) or []:
        if cond.get("type") in types and cond.get("status") == "True":
            return cond
    return None


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether `obj` is this RLJob's own child, and not going: a namesake's left over from a
    deleted RLJob of the same name (still waiting for the garbage collector) is not."""
    meta = obj.get("metadata", {})
    refs = [r for r in meta.get("ownerReferences", []) or [] if r.get("controller")]
    return not meta.get("deletionTimestamp") and any(r.get("uid") == uid for r in refs)


def current_pods(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods of this incarnation of the trainer Job (a deleted one's pods may linger)."""
    uid = job["metadata"]["uid"]
    return [p for p in pods if p["metadata"].get("labels", {}).get(JOB_UID_LABEL) == uid]


def members(job: dict[str, Any] | None, pods: list[dict[str, Any]], *phases: str) -> int:
    """Members of this Job's gang in one of `phases`, not counting pods being deleted."""
    if job is None:
        return 0
    return sum(
        1
        for p in current_pods(job, pods)
        if p.get("status", {}).get("phase") in phases and not p["metadata"].get("deletionTimestamp")
    )


def gang_failure(
    job: dict[str, Any], pods: list[dict[str, Any]], spec_replicas: int, timeout: float, now: float
) -> tuple[str, str] | None:
    """(reason, message) when the gang must be restarted, else None. `spec_replicas` is only the
    fallback when the Job does not say how many members it has."""
    cond = _job_condition(job, "Failed", "FailureTarget")
    if cond:
        return "TrainerFailed", f"trainer Job failed: {cond.get('reason', '')} {cond.get('message', '')}".strip()
    for pod in current_pods(job, pods):
        if pod.get("status", {}).get("phase") == "Failed":
            return "TrainerFailed", f"trainer pod {pod['metadata']['name']} failed"
    if job.get("spec", {}).get("suspend"):
        return None
    # The gang this Job runs is its own parallelism, not the spec's replicas, which may already
    # ask for a different gang (a spec change not yet rolled out). Finished members have started:
    # ranks exit one after another (rank 0 writes the final checkpoint last).
    size = int(job.get("spec", {}).get("parallelism") or spec_replicas)
    began = parse_time(job.get("status", {}).get("startTime") or job["metadata"].get("creationTimestamp"))
    started = members(job, pods, "Running", "Succeeded")
    if began is not None and now - began > timeout and started < size:
        return "GangScheduleTimeout", f"only {started}/{size} trainers started after {int(timeout)}s"
    return None


def decide_trainer(
    job: RLJob, prev: RLJobStatus, obs: Observed, now: float, backoff: Callable[[int], float]
) -> TrainerDecision:
    """What to do with the trainer gang in this pass (pure; see gang.py for the all-or-nothing story)."""
    if prev.phase in TERMINAL:
        return TrainerDecision("none")
    tj = obs.trainer_job
    if tj is not None and tj["metadata"].get("deletionTimestamp"):
        return TrainerDecision("wait", "GangRestarting", "waiting for the previous trainer gang to be deleted")
    if tj is not None:
        if _job_condition(tj, "Complete", "SuccessCriteriaMet"):
            return TrainerDecision("succeeded", "TrainerSucceeded", "the trainer gang finished")
        # A gang on an outdated spec is replaced whatever state it is in, and that is not a
        # failure: judged against the new spec (more replicas, say) it would look like one.
        if tj["metadata"].get("annotations", {}).get(ANNOTATION_TRAINER_HASH) != trainer_hash(job):
            return TrainerDecision("delete", "SpecChanged", "trainer inputs changed: restarting the gang")
        if job.spec.suspend and job.spec.queue_name:
            # Kueue resumes a suspended Job it has admitted: a queued gang is deleted instead,
            # which also gives its quota back; resuming queues a new one.
            return TrainerDecision("delete", "Suspended", "spec.suspend is true: the queued gang is deleted")
        spec = job.spec.trainer
        failure = gang_failure(tj, obs.trainer_pods, spec.replicas, spec.schedule_timeout_seconds, now)
        if failure:
            uid = tj["metadata"]["uid"]
            if uid == prev.counted_failure_uid:
                return TrainerDecision("delete", "GangRestarting", "deleting the failed trainer gang")
            if prev.restarts + 1 > job.spec.restart_limit:
                return TrainerDecision(
                    "fail",
                    "RestartLimitExceeded",
                    f"{failure[1]}; restart limit {job.spec.restart_limit} reached",
                    uid,
                )
            return TrainerDecision("restart", failure[0], failure[1], uid)
        return TrainerDecision("apply")
    if job.spec.suspend and job.spec.queue_name:
        return TrainerDecision("wait", "Suspended", "spec.suspend is true: no gang is queued")
    last = parse_time(prev.last_restart_time)
    if last is not None and now < last + backoff(prev.restarts):
        wait = int(last + backoff(prev.restarts) - now) + 1
        return TrainerDecision("wait", "RestartBackoff", f"recreating the trainer gang in {wait}s")
    return TrainerDecision("apply")


def preflight_outcome(reason: str, gang_exists: bool) -> Literal["fail", "hold", "pending"]:
    """What a failed preflight check does to the job. A job whose trainer Job exists is held
    (Ready=False, checked again next pass): the check may be transient (discovery right after an
    API server restart), and failing it would leave its trainers running under a Failed job. A new
    job fails when its gang provider is missing, and waits for objects that may yet appear."""
    if gang_exists:
        return "hold"
    return "fail" if reason in ("GangProviderUnavailable", "KueueUnavailable") else "pending"


def rollouts_forced_off(job: RLJob, decision: TrainerDecision) -> bool:
    """Whether the job wants no rollout workers whatever the backlog: suspended or finishing."""
    return job.spec.suspend or decision.action in ("fail", "succeeded")
