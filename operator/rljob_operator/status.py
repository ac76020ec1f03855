"""Pure status logic: from observed children and trainer metrics to phase, conditions and the
trainer gang's next action. No API calls and no clock reads here; the handler passes `now`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from rljob.config import RLJob
from rljob.protocol import TrainerMetrics
from rljob_operator.api import Condition, RLJobStatus
from rljob_operator.kueue import queued
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


def running_members(job: dict[str, Any] | None, pods: list[dict[str, Any]]) -> int:
    if job is None:
        return 0
    return sum(
        1
        for p in current_pods(job, pods)
        if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )


def started_members(job: dict[str, Any] | None, pods: list[dict[str, Any]]) -> int:
    """Members that are running or already finished: a gang whose ranks exit one after another
    (rank 0 writes the final checkpoint last) has started, whatever the Job's condition says yet."""
    if job is None:
        return 0
    return sum(
        1
        for p in current_pods(job, pods)
        if p.get("status", {}).get("phase") in ("Running", "Succeeded") and not p["metadata"].get("deletionTimestamp")
    )


def gang_size(job: dict[str, Any], default: int) -> int:
    """Members of the gang this Job runs: its own parallelism, not the spec's replicas, which may
    already ask for a different gang (a spec change not yet rolled out)."""
    return int(job.get("spec", {}).get("parallelism") or default)


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
    members = gang_size(job, spec_replicas)
    started = parse_time(job.get("status", {}).get("startTime") or job["metadata"].get("creationTimestamp"))
    if started is not None and now - started > timeout and started_members(job, pods) < members:
        return (
            "GangScheduleTimeout",
            f"only {started_members(job, pods)}/{members} trainers started after {int(timeout)}s",
        )
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


PreflightOutcome = Literal["fail", "hold", "pending"]


def preflight_outcome(reason: str, gang_exists: bool) -> PreflightOutcome:
    """What a failed preflight check does to the job. A job whose trainer Job exists is held
    (Ready=False, checked again next pass): the check may be transient (discovery right after an
    API server restart), and failing it would leave its trainers running under a Failed job. A new
    job fails when its gang provider is missing, and waits for objects that may yet appear."""
    if gang_exists:
        return "hold"
    return "fail" if reason in ("GangProviderUnavailable", "KueueUnavailable") else "pending"


def set_condition(
    conditions: list[Condition], ctype: str, status: bool | None, reason: str, message: str, now: str, generation: int
) -> list[Condition]:
    """Upsert one condition; lastTransitionTime moves only when the status changes."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out = [c for c in conditions if c.type != ctype]
    old = next((c for c in conditions if c.type == ctype), None)
    since = old.last_transition_time if old is not None and old.status == value else now
    out.append(
        Condition(
            type=ctype,
            status=value,
            reason=reason,
            message=message,
            last_transition_time=since,
            observed_generation=generation,
        )
    )
    return sorted(out, key=lambda c: c.type)


def held_status(prev: RLJobStatus, generation: int, reason: str, message: str, now: float) -> RLJobStatus:
    """The status of a pass that applied nothing of a new generation (the API server refused a
    child, or the spec is invalid): everything as it was, Ready false saying why. The observed
    generation stays where it was, because this generation is not in effect."""
    st = prev.model_copy(deep=True)
    st.phase = prev.phase or "Pending"
    st.conditions = set_condition(st.conditions, "Ready", False, reason, message, iso(now), generation)
    return st


def finished_rollouts(prev: RLJobStatus, rollout: dict[str, Any] | None) -> RLJobStatus:
    """A finished job's rollout numbers from its Deployment as it scales to zero: the completing
    pass read "ready" before the scale-down, and no later pass recomputes the status."""
    st = prev.model_copy(deep=True)
    _set_rollouts(st, rollout, 0)
    return st


def _set_rollouts(st: RLJobStatus, rollout: dict[str, Any] | None, desired: int) -> int:
    """Write the rollout Deployment's ready and desired counts into `st`; returns the ready count."""
    ready = int((rollout or {}).get("status", {}).get("readyReplicas", 0) or 0)
    st.rollout_replicas_desired = desired
    st.rollout_replicas_ready = ready
    st.rollouts = f"{ready}/{desired}"
    return ready


def failed_reason(st: RLJobStatus) -> str | None:
    return next((c.reason for c in st.conditions if c.type == "Failed" and c.status == "True"), None)


def rollouts_forced_off(job: RLJob, decision: TrainerDecision) -> bool:
    """Whether the job wants no rollout workers whatever the backlog: suspended or finishing."""
    return job.spec.suspend or decision.action in ("fail", "succeeded")


def idle_at_zero(job: RLJob, decision: TrainerDecision) -> bool:
    """Zero rollout workers is what a running job with `minReplicas: 0` and no backlog asks for:
    healthy, not a missing component (unlike zero because suspended or finished)."""
    return job.spec.rollout.min_replicas == 0 and not rollouts_forced_off(job, decision)


def compute_status(
    job: RLJob,
    generation: int,
    prev: RLJobStatus,
    obs: Observed,
    decision: TrainerDecision,
    rollout_desired: int,
    metrics: TrainerMetrics | None,
    metrics_error: str | None,
    now: float,
) -> RLJobStatus:
    """The next status: phase, conditions and progress numbers."""
    stamp = iso(now)
    st = prev.model_copy(deep=True)
    st.observed_generation = generation
    st.total_steps = job.spec.grpo.total_steps
    if decision.failed_uid:
        st.restarts = prev.restarts + (1 if decision.action == "restart" else 0)
        st.counted_failure_uid = decision.failed_uid
        st.last_restart_time = stamp
    if metrics is not None:
        st.step = metrics.step
        st.policy_version = metrics.policy_version
        st.mean_reward = round(metrics.mean_reward, 4)
        st.last_step_seconds = round(metrics.step_seconds, 3)
        st.weight_bytes_last_step = metrics.weight_bytes
        st.groups_generated = metrics.groups_generated_total
        st.groups_dropped = metrics.groups_dropped_total
        if metrics.eval_exact_match is not None:
            st.eval_exact_match = round(metrics.eval_exact_match, 4)
        if metrics.eval_f1 is not None:
            st.eval_f1 = round(metrics.eval_f1, 4)

    replicas = job.spec.trainer.replicas
    running = running_members(obs.trainer_job, obs.trainer_pods)
    waiting = queued(job, obs.trainer_job, obs.quota_reservation) if decision.action == "apply" else None
    ready_rollouts = _set_rollouts(st, obs.rollout, rollout_desired)

    if decision.action == "fail" or prev.phase == "Failed":
        phase = "Failed"
    elif decision.action == "succeeded" or prev.phase == "Succeeded":
        phase = "Succeeded"
    elif obs.preflight_reason:
        phase = "Pending"
    elif job.spec.suspend:
        phase = "Suspended"
    elif waiting:
        phase = "Queued"
    elif decision.action in ("restart", "delete", "wait"):
        phase = "Pending"  # the gang is being replaced (failure, spec change) or waits for a backoff
    elif obs.trainer_job is not None and running == replicas:
        phase = "Running"
    elif any(p.get("spec", {}).get("nodeName") for p in obs.trainer_pods):
        phase = "Initializing"
    else:
        phase = "Pending"
    if phase != prev.phase and phase in ("Running", "Initializing") and not st.start_time:
        st.start_time = stamp
    if phase in TERMINAL and not st.completion_time:
        st.completion_time = stamp
    st.phase = phase

    c = st.conditions
    gen = generation
    if obs.preflight_reason:
        trainers = (False, obs.preflight_reason, obs.preflight_message)
    elif phase == "Succeeded":
        trainers = (False, "Completed", "the trainer gang finished")
    elif phase == "Suspended":
        trainers = (False, "Suspended", "spec.suspend is true: trainer pods deleted, state kept")
    elif waiting:
        trainers = (False, *waiting)
    elif decision.reason:
        trainers = (False, decision.reason, decision.message)
    elif running == replicas and obs.trainer_job is not None:
        trainers = (True, "GangRunning", f"{running}/{replicas} trainers running")
    else:
        trainers = (False, "GangPending", f"{running}/{replicas} trainers running")
    c = set_condition(c, "TrainersReady", *trainers, stamp, gen)
    if rollout_desired == 0 and idle_at_zero(job, decision):
        rollout = (True, "ScaledToZero", "no backlog: scaled to zero (rollout.minReplicas is 0)")
    elif rollout_desired == 0:
        rollout = (False, "ScaledToZero", "no rollout workers wanted")
    elif ready_rollouts >= rollout_desired:
        rollout = (True, "Available", f"{ready_rollouts}/{rollout_desired} rollout workers ready")
    else:
        rollout = (False, "Unavailable", f"{ready_rollouts}/{rollout_desired} rollout workers ready")
    c = set_condition(c, "RolloutReady", *rollout, stamp, gen)
    if obs.external_redis:
        store = (True, "ExternalRedis", "using the external Redis")
    elif int((obs.redis or {}).get("status", {}).get("readyReplicas", 0) or 0) >= 1:
        store = (True, "RedisReady", "managed Redis is ready")
    else:
        store = (False, "RedisNotReady", "managed Redis is not ready")
    c = set_condition(c, "WeightStoreReady", *store, stamp, gen)
    if metrics_error:
        c = set_condition(c, "MetricsAvailable", False, "RedisUnreachable", metrics_error, stamp, gen)
    elif metrics is None:
        c = set_condition(c, "MetricsAvailable", False, "NoMetricsYet", "the trainer has not reported", stamp, gen)
    else:
        c = set_condition(c, "MetricsAvailable", True, "MetricsRead", f"step {metrics.step}", stamp, gen)
    parts = {x.type: x for x in c}
    ready = all(parts[t].status == "True" for t in ("TrainersReady", "RolloutReady", "WeightStoreReady"))
    not_ready = [t for t in ("TrainersReady", "RolloutReady", "WeightStoreReady") if parts[t].status != "True"]
    c = set_condition(
        c,
        "Ready",
        ready,
        "AllReady" if ready else (obs.preflight_reason or "NotReady"),
        "all components ready" if ready else "not ready: " + ", ".join(not_ready),
        stamp,
        gen,
    )
    progressing = phase == "Running"
    c = set_condition(
        c,
        "Progressing",
        progressing,
        "Training" if progressing else phase,
        f"step {st.step or 0}/{st.total_steps}",
        stamp,
        gen,
    )
    done = phase == "Succeeded"
    c = set_condition(c, "Complete", done, "TrainerSucceeded" if done else "NotComplete", "", stamp, gen)
    failed_reason = (
        decision.reason
        if decision.action == "fail"
        else (next((x.reason for x in prev.conditions if x.type == "Failed" and x.status == "True"), "NotFailed"))
    )
    failed_msg = (
        decision.message
        if decision.action == "fail"
        else (next((x.message for x in prev.conditions if x.type == "Failed" and x.status == "True"), ""))
    )
    c = set_condition(c, "Failed", phase == "Failed", failed_reason, failed_msg, stamp, gen)
    st.conditions = c
    return st
