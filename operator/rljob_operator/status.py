"""Pure status logic: from what a pass observed and decided (`decide`) and the trainer's metrics to
phase and conditions. No API calls and no clock reads here; the reconciler passes `now`.
"""

from __future__ import annotations

from typing import Any

from rljob.config import RLJob
from rljob.protocol import TrainerMetrics
from rljob_operator.api import Condition, RLJobStatus
from rljob_operator.decide import (
    TERMINAL,
    Observed,
    TrainerDecision,
    iso,
    members,
    rollouts_forced_off,
)
from rljob_operator.kueue import queued


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


def failed_condition(st: RLJobStatus) -> Condition | None:
    return next((c for c in st.conditions if c.type == "Failed" and c.status == "True"), None)


def failed_reason(st: RLJobStatus) -> str | None:
    failed = failed_condition(st)
    return failed.reason if failed else None


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
    running = members(obs.trainer_job, obs.trainer_pods, "Running")
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
    # Zero workers is what a running job with `minReplicas: 0` and no backlog asks for: healthy, not a
    # missing component (unlike zero because suspended or finished).
    if rollout_desired == 0 and job.spec.rollout.min_replicas == 0 and not rollouts_forced_off(job, decision):
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
    not_ready = [t for t in ("TrainersReady", "RolloutReady", "WeightStoreReady") if parts[t].status != "True"]
    if not_ready:
        ready = (False, obs.preflight_reason or "NotReady", "not ready: " + ", ".join(not_ready))
    else:
        ready = (True, "AllReady", "all components ready")
    c = set_condition(c, "Ready", *ready, stamp, gen)
    progressing = (True, "Training") if phase == "Running" else (False, phase)
    c = set_condition(c, "Progressing", *progressing, f"step {st.step or 0}/{st.total_steps}", stamp, gen)
    done = phase == "Succeeded"
    c = set_condition(c, "Complete", done, "TrainerSucceeded" if done else "NotComplete", "", stamp, gen)
    was_failed = failed_condition(prev)
    if decision.action == "fail":
        failed = (decision.reason, decision.message)
    else:
        failed = (was_failed.reason, was_failed.message) if was_failed else ("NotFailed", "")
    c = set_condition(c, "Failed", phase == "Failed", *failed, stamp, gen)
    st.conditions = c
    return st
