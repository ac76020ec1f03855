"""Status logic: phases, conditions, gang-failure decisions, restart counting, backoff."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.config import RLJob
from rljob.protocol import TrainerMetrics
from rljob_operator.api import RLJobStatus
from rljob_operator.decide import (
    Observed,
    TrainerDecision,
    controlled_by,
    decide_trainer,
    gang_failure,
    iso,
    preflight_outcome,
)
from rljob_operator.names import ANNOTATION_TRAINER_HASH
from rljob_operator.render import trainer_hash
from rljob_operator.settings import OperatorSettings
from rljob_operator.status import compute_status, failed_reason, finished_rollouts, held_status

NOW = 1_800_000_000.0


def backoff(restarts: int) -> float:
    return 10.0 * 2 ** (restarts - 1) if restarts else 0.0


def make(**spec: Any) -> RLJob:
    return RLJob.model_validate({"metadata": {"name": "j", "namespace": "ns"}, "spec": spec})


def trainer_job(
    job: RLJob, uid: str = "job-uid", conditions: list[dict] | None = None, started: float = NOW - 5, **meta: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "uid": uid,
            "name": "j-trainer",
            "creationTimestamp": iso(started),
            "annotations": {ANNOTATION_TRAINER_HASH: trainer_hash(job)},
            **meta,
        },
        "spec": {"suspend": False},
        "status": {"startTime": iso(started), "conditions": conditions or []},
    }


def pod(name: str, phase: str, uid: str = "job-uid", node: str | None = "kwok-gpu-0") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"batch.kubernetes.io/controller-uid": uid}},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def cond(st: RLJobStatus, ctype: str):
    return next(c for c in st.conditions if c.type == ctype)


def test_running_gang_gives_running_phase_and_conditions() -> None:
    job = make(trainer={"replicas": 2})
    obs = Observed(
        trainer_job=trainer_job(job),
        trainer_pods=[pod("a", "Running"), pod("b", "Running")],
        rollout={"status": {"readyReplicas": 1}},
        redis={"status": {"readyReplicas": 1}},
    )
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, backoff)
    assert decision.action == "apply"
    metrics = TrainerMetrics(
        step=3,
        policy_version=3,
        mean_reward=0.25,
        eval_exact_match=0.1,
        eval_f1=0.2,
        weight_bytes=1234,
        step_seconds=2.5,
    )
    st = compute_status(job, 1, RLJobStatus(), obs, decision, 1, metrics, None, NOW)
    assert st.phase == "Running" and st.step == 3 and st.policy_version == 3 and st.mean_reward == 0.25
    assert st.eval_exact_match == 0.1 and st.weight_bytes_last_step == 1234 and st.rollouts == "1/1"
    for ctype in ("Ready", "TrainersReady", "RolloutReady", "WeightStoreReady", "Progressing", "MetricsAvailable"):
        assert cond(st, ctype).status == "True", ctype
    assert cond(st, "Complete").status == "False" and cond(st, "Failed").status == "False"
    assert all(c.observed_generation == 1 for c in st.conditions)


def test_partial_gang_is_not_running_and_redis_errors_degrade() -> None:
    job = make(trainer={"replicas": 2})
    obs = Observed(trainer_job=trainer_job(job), trainer_pods=[pod("a", "Running"), pod("b", "Pending", node=None)])
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, backoff)
    st = compute_status(job, 1, RLJobStatus(), obs, decision, 1, None, "ConnectionError: no route", NOW)
    assert st.phase == "Initializing"
    assert cond(st, "TrainersReady").status == "False"
    metrics = cond(st, "MetricsAvailable")
    assert (metrics.status, metrics.reason) == ("False", "RedisUnreachable")
    assert metrics.message == "ConnectionError: no route"
    assert cond(st, "WeightStoreReady").reason == "RedisNotReady"


def test_member_failure_restarts_whole_gang_once() -> None:
    job = make(trainer={"replicas": 2}, restartLimit=2)
    obs = Observed(trainer_job=trainer_job(job), trainer_pods=[pod("a", "Failed"), pod("b", "Running")])
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, backoff)
    assert (decision.action, decision.reason, decision.failed_uid) == ("restart", "TrainerFailed", "job-uid")
    st = compute_status(job, 1, RLJobStatus(), obs, decision, 1, None, None, NOW)
    assert st.restarts == 1 and st.counted_failure_uid == "job-uid" and st.last_restart_time == iso(NOW)
    assert st.phase == "Pending" and cond(st, "TrainersReady").reason == "TrainerFailed"
    # The same failed Job seen again (deletion in flight) is not counted again.
    again = decide_trainer(job, st, obs, NOW + 1, backoff)
    assert again.action == "delete" and again.failed_uid is None
    st2 = compute_status(job, 1, st, obs, again, 1, None, None, NOW + 1)
    assert st2.restarts == 1


def test_backoff_then_recreate() -> None:
    job = make()
    prev = RLJobStatus(restarts=2, last_restart_time=iso(NOW))
    assert decide_trainer(job, prev, Observed(), NOW + 5, backoff).reason == "RestartBackoff"
    assert decide_trainer(job, prev, Observed(), NOW + 21, backoff).action == "apply"
    deleting = trainer_job(job, deletionTimestamp=iso(NOW))
    assert decide_trainer(job, RLJobStatus(), Observed(trainer_job=deleting), NOW, backoff).action == "wait"


def test_restart_limit_turns_job_failed_with_reason() -> None:
    job = make(restartLimit=1)
    prev = RLJobStatus(restarts=1, counted_failure_uid="old")
    failed_cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
    failed = trainer_job(job, uid="new", conditions=[failed_cond])
    decision = decide_trainer(job, prev, Observed(trainer_job=failed), NOW, backoff)
    assert decision.action == "fail" and decision.reason == "RestartLimitExceeded"
    st = compute_status(job, 1, prev, Observed(trainer_job=failed), decision, 0, None, None, NOW)
    assert st.phase == "Failed" and st.completion_time == iso(NOW)
    assert cond(st, "Failed").status == "True" and cond(st, "Failed").reason == "RestartLimitExceeded"
    assert decide_trainer(job, st, Observed(trainer_job=failed), NOW, backoff).action == "none"


def test_schedule_timeout_counts_as_gang_failure() -> None:
    job = make(trainer={"replicas": 2, "scheduleTimeoutSeconds": 60})
    obs = Observed(trainer_job=trainer_job(job, started=NOW - 61), trainer_pods=[pod("a", "Running")])
    decision = decide_trainer(job, RLJobStatus(), obs, NOW, backoff)
    assert decision.action == "restart" and decision.reason == "GangScheduleTimeout"


def test_a_gang_finishing_rank_by_rank_is_not_a_schedule_timeout() -> None:
    # Rank 1 has exited, rank 0 still writes the final checkpoint, and the Job has no Complete
    # condition yet: long after the schedule timeout, that gang started and must be left alone.
    job = make(trainer={"replicas": 2, "scheduleTimeoutSeconds": 60})
    finishing = Observed(
        trainer_job=trainer_job(job, started=NOW - 3600), trainer_pods=[pod("a", "Running"), pod("b", "Succeeded")]
    )
    assert decide_trainer(job, RLJobStatus(), finishing, NOW, backoff).action == "apply"
    # One member still unscheduled after the timeout is a gang that never started.
    stuck = Observed(
        trainer_job=trainer_job(job, started=NOW - 61), trainer_pods=[pod("a", "Succeeded"), pod("b", "Pending")]
    )
    decision = decide_trainer(job, RLJobStatus(), stuck, NOW, backoff)
    assert decision.action == "restart" and "1/2 trainers started" in decision.message


def test_completed_trainer_means_succeeded() -> None:
    job = make()
    done = trainer_job(job, conditions=[{"type": "Complete", "status": "True"}])
    decision = decide_trainer(job, RLJobStatus(), Observed(trainer_job=done), NOW, backoff)
    st = compute_status(job, 1, RLJobStatus(), Observed(trainer_job=done), decision, 0, None, None, NOW)
    assert st.phase == "Succeeded" and cond(st, "Complete").status == "True"


def test_spec_change_restarts_gang_without_counting() -> None:
    running = trainer_job(make())
    changed = make(grpo={"learningRate": 1e-3})
    decision = decide_trainer(changed, RLJobStatus(), Observed(trainer_job=running), NOW, backoff)
    assert decision.action == "delete" and decision.reason == "SpecChanged" and decision.failed_uid is None


def test_more_replicas_on_a_long_running_gang_is_a_spec_change_not_a_failure() -> None:
    # A gang of 2, running for an hour (far past the schedule timeout); the spec now asks for 4.
    # Judged against the new spec it would be "2/4 started": a counted failure, and with
    # restartLimit 0 a Failed job. It is a spec change: replaced, not counted.
    old, new = make(trainer={"replicas": 2}, restartLimit=0), make(trainer={"replicas": 4}, restartLimit=0)
    running = trainer_job(old, started=NOW - 3600)
    running["spec"]["parallelism"] = 2
    obs = Observed(trainer_job=running, trainer_pods=[pod("a", "Running"), pod("b", "Running")])
    prev = RLJobStatus(phase="Running")
    decision = decide_trainer(new, prev, obs, NOW, backoff)
    assert (decision.action, decision.reason, decision.failed_uid) == ("delete", "SpecChanged", None)
    st = compute_status(new, 2, prev, obs, decision, 1, None, None, NOW)
    assert st.phase == "Pending" and st.restarts == 0 and cond(st, "Failed").status == "False"
    # The schedule timeout counts the members the Job runs, not the ones the spec asks for.
    assert gang_failure(running, obs.trainer_pods, 4, 60, NOW) is None
    assert gang_failure(running, obs.trainer_pods[:1], 4, 60, NOW) == (
        "GangScheduleTimeout",
        "only 1/2 trainers started after 60s",
    )


def test_suspended_and_preflight_phases() -> None:
    job = make(suspend=True)
    st = compute_status(
        job,
        2,
        RLJobStatus(),
        Observed(),
        decide_trainer(job, RLJobStatus(), Observed(), NOW, backoff),
        0,
        None,
        None,
        NOW,
    )
    assert st.phase == "Suspended" and cond(st, "TrainersReady").reason == "Suspended"
    obs = Observed(preflight_reason="RedisSecretNotFound", preflight_message="weightSync.redis.passwordSecret x")
    st = compute_status(
        make(), 1, RLJobStatus(), obs, decide_trainer(make(), RLJobStatus(), obs, NOW, backoff), 0, None, None, NOW
    )
    assert st.phase == "Pending" and cond(st, "Ready").reason == "RedisSecretNotFound"


def test_transition_time_moves_only_on_change() -> None:
    job = make()
    obs = Observed()
    first = compute_status(
        job, 1, RLJobStatus(), obs, decide_trainer(job, RLJobStatus(), obs, NOW, backoff), 1, None, None, NOW
    )
    second = compute_status(
        job, 1, first, obs, decide_trainer(job, first, obs, NOW + 50, backoff), 1, None, None, NOW + 50
    )
    assert cond(second, "TrainersReady").last_transition_time == iso(NOW)


def test_operator_backoff_doubles_and_caps() -> None:
    s = OperatorSettings(
        "ns",
        "keda",
        1,
        restart_backoff_seconds=5,
        restart_backoff_max_seconds=30,
        redis_timeout_seconds=1,
        metrics_port=0,
    )
    assert [s.restart_backoff(n) for n in range(5)] == [0, 5, 10, 20, 30]


def test_a_held_pass_keeps_everything_but_says_why_in_ready() -> None:
    # The API server refused a child of generation 3 (or the spec is invalid): nothing of it is in
    # effect, so the status stays at generation 2, with the reason in Ready for generation 3.
    job = make(trainer={"replicas": 2})
    obs = Observed(
        trainer_job=trainer_job(job),
        trainer_pods=[pod("a", "Running"), pod("b", "Running")],
        rollout={"status": {"readyReplicas": 3}},
        redis={"status": {"readyReplicas": 1}},
    )
    running = compute_status(
        job, 2, RLJobStatus(), obs, decide_trainer(job, RLJobStatus(), obs, NOW, backoff), 3, None, None, NOW
    )
    held = held_status(running, 3, "ApplyRejected", "Deployment j-rollout: denied by policy", NOW + 1)
    assert held.phase == "Running" and held.observed_generation == 2
    ready = cond(held, "Ready")
    assert (ready.status, ready.reason, ready.message) == (
        "False",
        "ApplyRejected",
        "Deployment j-rollout: denied by policy",
    )
    assert ready.observed_generation == 3
    assert [c for c in held.conditions if c.type != "Ready"] == [c for c in running.conditions if c.type != "Ready"]
    assert held_status(RLJobStatus(), 1, "ApplyRejected", "x", NOW).phase == "Pending"  # a new job: nothing built


def test_invalid_spec_message_names_the_field_once() -> None:
    from pydantic import ValidationError

    from rljob.config import RLJob as Model
    from rljob_operator.reconcile import invalid_spec_message

    try:
        Model.model_validate(
            {"spec": {"weightSync": {"redis": {"externalUrl": "redis://r:99999", "passwordSecret": "s"}}}}
        )
    except ValidationError as exc:
        message = invalid_spec_message(exc)
    assert message.startswith("spec.weightSync.redis.externalUrl: ") and "spec.spec" not in message
    assert "Port out of range" in message
    failed = compute_status(
        make(), 1, RLJobStatus(), Observed(), TrainerDecision("fail", "InvalidSpec", message), 0, None, None, NOW
    )
    assert failed.phase == "Failed" and failed_reason(failed) == "InvalidSpec"


def test_forgetting_a_deleted_job_drops_its_metric_series() -> None:
    import logging

    from prometheus_client import REGISTRY

    from rljob_operator import metrics as prom
    from rljob_operator.reconcile import Reconciler

    settings = OperatorSettings("rljob-system", "keda", 1.0, 1.0, 10.0, redis_timeout_seconds=0.5, metrics_port=0)
    reconciler = Reconciler(kube=None, settings=settings, post_event=lambda *a: None, log=logging.getLogger("t"))  # type: ignore[arg-type]
    for gauge in (prom.JOB_STEP, prom.JOB_REWARD, prom.ROLLOUT_DESIRED):
        gauge.labels("gone-ns", "gone").set(3)
    labels = {"namespace": "gone-ns", "name": "gone"}
    assert REGISTRY.get_sample_value("rljob_job_step", labels) == 3
    reconciler.forget("gone-ns", "gone")
    reconciler.forget("gone-ns", "gone")  # twice (kopf may retry a deletion handler): no error
    for metric in ("rljob_job_step", "rljob_job_mean_reward", "rljob_job_rollout_replicas_desired"):
        assert REGISTRY.get_sample_value(metric, labels) is None


def test_a_deleted_namesakes_child_is_not_this_jobs() -> None:
    def secret(uid: str | None, **meta: Any) -> dict[str, Any]:
        refs = [{"kind": "RLJob", "name": "j", "uid": uid, "controller": True}] if uid else []
        return {"metadata": {"name": "j-redis", "ownerReferences": refs, **meta}}

    assert controlled_by(secret("new"), "new")
    assert not controlled_by(secret("old"), "new")  # the deleted RLJob of the same name's
    assert not controlled_by(secret(None), "new")
    assert not controlled_by(secret("new", deletionTimestamp=iso(NOW)), "new")


def test_a_failed_preflight_never_fails_a_job_whose_trainers_exist() -> None:
    # Discovery can miss a group right after an API server restart: a job already running is
    # held (Ready=False, checked again), or its trainers would run on under a Failed job.
    reasons = ("GangProviderUnavailable", "KueueUnavailable", "KedaUnavailable", "RedisSecretNotFound")
    for reason in (*reasons, "VolumeClaimNotFound"):
        assert preflight_outcome(reason, gang_exists=True) == "hold"
    assert preflight_outcome("GangProviderUnavailable", gang_exists=False) == "fail"
    assert preflight_outcome("KueueUnavailable", gang_exists=False) == "fail"  # else it would run past the queue
    assert preflight_outcome("VolumeClaimNotFound", gang_exists=False) == "pending"


def test_idle_scaled_to_zero_is_ready_when_min_replicas_is_zero() -> None:
    def status(job: RLJob) -> RLJobStatus:
        obs = Observed(
            trainer_job=trainer_job(job),
            trainer_pods=[pod("a", "Running")],
            rollout={"spec": {"replicas": 0}, "status": {}},
            redis={"status": {"readyReplicas": 1}},
        )
        prev = RLJobStatus(phase="Running")
        return compute_status(job, 1, prev, obs, decide_trainer(job, prev, obs, NOW, backoff), 0, None, None, NOW)

    idle = status(make(rollout={"minReplicas": 0}))
    assert (cond(idle, "RolloutReady").status, cond(idle, "RolloutReady").reason) == ("True", "ScaledToZero")
    assert cond(idle, "Ready").status == "True" and idle.phase == "Running"
    # Zero where the spec wants at least one (the pass that decided it before workers start) is not ready.
    wanting = status(make())
    assert (cond(wanting, "RolloutReady").status, cond(wanting, "Ready").status) == ("False", "False")
    suspended = status(make(rollout={"minReplicas": 0}, suspend=True))
    assert cond(suspended, "RolloutReady").status == "False"


def test_a_finished_job_reports_its_rollouts_going_to_zero() -> None:
    # The completing pass read one ready worker before scaling to zero; later passes of the
    # finished job follow the Deployment down instead of showing "1/0" forever.
    obs = Observed(
        trainer_job=trainer_job(make(), conditions=[{"type": "Complete", "status": "True"}]),
        rollout={"spec": {"replicas": 1}, "status": {"readyReplicas": 1}},
    )
    done = compute_status(make(), 1, RLJobStatus(), obs, TrainerDecision("succeeded"), 0, None, None, NOW)
    assert (done.phase, done.rollouts) == ("Succeeded", "1/0")
    draining = finished_rollouts(done, {"spec": {"replicas": 0}, "status": {"readyReplicas": 1}})
    assert draining == done  # nothing changed: no status write
    gone = finished_rollouts(done, {"spec": {"replicas": 0}, "status": {}})
    assert (gone.rollouts, gone.rollout_replicas_ready, gone.rollout_replicas_desired) == ("0/0", 0, 0)
    assert gone.phase == "Succeeded" and gone.conditions == done.conditions
    assert finished_rollouts(done, None).rollouts == "0/0"  # the Deployment already deleted


def test_a_failing_pass_is_counted_as_an_error() -> None:
    """`reconciles_total` counts attempts; the errors counter tells a failing operator apart."""
    import logging

    from prometheus_client import REGISTRY

    from rljob_operator.reconcile import Reconciler

    settings = OperatorSettings("rljob-system", "keda", 1.0, 1.0, 10.0, redis_timeout_seconds=0.5, metrics_port=0)
    broken = Reconciler(kube=None, settings=settings, post_event=lambda *a: None, log=logging.getLogger("t"))  # type: ignore[arg-type]
    before = REGISTRY.get_sample_value("rljob_operator_reconcile_errors_total") or 0.0
    last = REGISTRY.get_sample_value("rljob_operator_last_successful_reconcile_timestamp_seconds")
    with pytest.raises(AttributeError):  # no client at all: the first read fails
        broken.reconcile("ns", "j", full=False)
    assert REGISTRY.get_sample_value("rljob_operator_reconcile_errors_total") == before + 1
    assert REGISTRY.get_sample_value("rljob_operator_last_successful_reconcile_timestamp_seconds") == last
