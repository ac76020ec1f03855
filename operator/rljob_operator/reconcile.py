"""One reconcile pass for one RLJob: observe, decide (pure), apply, write status.

Called by the kopf handlers (spec changes, resume) and by the timer (status, failures,
autoscaling). Runs in kopf's thread pool, serialised per job by a lock, and re-reads the RLJob
first so a restart is never counted twice from a stale status.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import secrets as pysecrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rljob.config import RLJob
from rljob.keys import JobKeys
from rljob.protocol import TrainerMetrics
from rljob.queue.backlog import pending_prompts
from rljob_operator import metrics as prom
from rljob_operator.api import RLJobStatus
from rljob_operator.autoscale import rollout_replicas
from rljob_operator.decide import (
    TERMINAL,
    Observed,
    TrainerDecision,
    controlled_by,
    decide_trainer,
    iso,
    parse_time,
    preflight_outcome,
    rollouts_forced_off,
)
from rljob_operator.gang import GANG_KINDS, PROVIDER_APIS, WORKLOAD_APIS, referenced_workload
from rljob_operator.kube import RLJOB_API, ApiError, Kube
from rljob_operator.kueue import JOB_UID_LABEL, KUEUE_APIS, quota_reservation
from rljob_operator.names import ChildNames
from rljob_operator.render import (
    KEDA_API,
    KEDA_PAUSED,
    Manifest,
    RenderPlan,
    redis_password_secret,
    redis_url,
    render_children,
    render_keda,
    render_redis_secret,
    render_rollout_deployment,
)
from rljob_operator.settings import OperatorSettings
from rljob_operator.status import compute_status, failed_condition, failed_reason, finished_rollouts, held_status

PREFLIGHT_REASONS = (
    "GangProviderUnavailable",
    "KueueUnavailable",
    "KedaUnavailable",
    "RedisSecretNotFound",
    "VolumeClaimNotFound",
)
TRAINER_KINDS = ("Job", "Workload", "PodGroup")
EventFn = Callable[[dict[str, Any], str, str, str], None]


@dataclass
class JobMemory:
    """What the operator keeps of one RLJob between passes. Lost on a restart of the operator, and
    rebuilt from the cluster and the job's Redis: nothing here is a source of truth."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    password: str | None = None  # of the managed Redis, read from its Secret
    redis_retry_at: float = 0.0  # backoff after a failed read of the job's Redis
    redis_failures: int = 0
    last_redis_error: str | None = None
    last_metrics: TrainerMetrics | None = None  # what full passes (which do not read Redis) report
    next_child_check: float = 0.0

    def redis_failed(self, message: str, now: float) -> None:
        """Back off 2, 4, 8 .. 30 s (a new job's Redis is not up at the first reads yet, and its first
        backlog must reach the autoscaler soon). The Secret is read again: it may have been replaced."""
        self.password, self.last_redis_error = None, message
        self.redis_failures += 1
        self.redis_retry_at = now + min(30.0, 2.0**self.redis_failures)

    def redis_read(self, metrics: TrainerMetrics | None) -> None:
        self.redis_retry_at, self.redis_failures, self.last_redis_error = 0.0, 0, None
        if metrics is not None:
            self.last_metrics = metrics


@dataclass
class _Pass:
    """One pass's view of a valid, unfinished RLJob, before it decides anything."""

    body: dict[str, Any]
    job: RLJob
    names: ChildNames
    stored: RLJobStatus  # the status on the object: what a write is compared with
    prev: RLJobStatus  # where decisions start (empty once an invalid spec was replaced)
    generation: int
    now: float
    full: bool
    obs: Observed

    @property
    def spec_changed(self) -> bool:
        return self.prev.observed_generation != self.generation


@dataclass
class Reconciler:
    kube: Kube
    settings: OperatorSettings
    post_event: EventFn
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("rljob_operator"))
    _jobs: dict[tuple[str, str], JobMemory] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _api_cache: dict[str, tuple[bool, float]] = field(default_factory=dict)

    def memory(self, namespace: str, name: str) -> JobMemory:
        with self._guard:
            return self._jobs.setdefault((namespace, name), JobMemory())

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._jobs.pop((namespace, name), None)
        for gauge in (prom.JOB_STEP, prom.JOB_REWARD, prom.ROLLOUT_DESIRED):  # no stale series of a deleted job
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)

    def reconcile(self, namespace: str, name: str, *, full: bool) -> None:
        """One pass; a pass that raises is counted (`reconcile_errors_total`), since attempts alone
        cannot tell a healthy operator from one failing every pass."""
        prom.RECONCILES.labels(kind="full" if full else "timer").inc()
        try:
            with prom.RECONCILE_SECONDS.time(), self.memory(namespace, name).lock:
                self._pass(namespace, name, full=full or self.settings.always_full)
        except Exception:
            prom.RECONCILE_ERRORS.inc()
            raise
        prom.LAST_SUCCESS.set_to_current_time()

    def _pass(self, namespace: str, name: str, *, full: bool) -> None:
        body = self.kube.get(RLJOB_API, "RLJob", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            self._reconcile(body, full=full)
        except ApiError as exc:
            if exc.status == 403 and "NamespaceTerminating" in exc.body:
                return  # the namespace is going, and the RLJob with it: nothing to build or retry
            self._report_error(body, exc)
            raise

    def _report_error(self, body: dict[str, Any], exc: ApiError) -> None:
        """Say on the RLJob why the pass failed (Ready=False, ReconcileError, one event): kopf
        retries the pass, but posts no event and writes no status of its own."""
        stored = _stored_status(body)
        generation = body["metadata"].get("generation", 1)
        message = f"{exc.status} {exc.reason}: {exc.message}"[:1000]
        try:
            self._hold(body, stored, generation, "ReconcileError", message, time.time())
        except ApiError as again:  # the API server may be what failed; the original error is raised
            self.log.warning("could not report a reconcile error on the RLJob: %s", again)

    # ---- steps -------------------------------------------------------------------------------

    def _reconcile(self, body: dict[str, Any], *, full: bool) -> None:
        """Observe, decide (pure), apply, write status; a step that settles the pass ends it."""
        step = self._begin(body, full=full)
        if step is None or self._stopped_by_preflight(step):
            return
        self._observe_children(step.job, step.names, step.obs)
        decision = decide_trainer(step.job, step.prev, step.obs, step.now, self.settings.restart_backoff)
        final = decision.action in ("succeeded", "fail")
        metrics, backlog, metrics_error = self._observe_redis(step.job, full=full, final=final)
        scaled_at = parse_time(step.prev.last_scale_time)
        since = None if scaled_at is None else step.now - scaled_at
        forced_off = rollouts_forced_off(step.job, decision)
        current, desired = rollout_replicas(
            step.job, step.obs.rollout, backlog, forced_off=forced_off, seconds_since_scale=since
        )
        decision, held = self._apply_children(step, decision, desired, rescale=desired != current)
        if held:
            self._hold(body, step.stored, step.generation, *held, step.now)
            return
        st = compute_status(
            step.job, step.generation, step.prev, step.obs, decision, desired, metrics, metrics_error, step.now
        )
        self._report(step, decision, st, desired)

    def _begin(self, body: dict[str, Any], *, full: bool) -> _Pass | None:
        """The pass's view of a valid, unfinished RLJob; None when the spec is invalid or the job
        has finished (both handled here)."""
        meta = body["metadata"]
        generation, now = meta.get("generation", 1), time.time()
        stored = prev = _stored_status(body)
        identity = {"name": meta["name"], "namespace": meta["namespace"]}
        try:
            job = RLJob.model_validate({"metadata": identity, "spec": body.get("spec") or {}})
        except ValidationError as exc:
            self._invalid(body, prev, generation, now, exc)
            return None
        if prev.phase in TERMINAL:
            if not (failed_reason(prev) == "InvalidSpec" and prev.observed_generation != generation):
                self._finished(body, job, prev, now)
                return None
            prev = RLJobStatus()  # the spec that failed validation was replaced: start from scratch
        names = ChildNames(meta["name"], meta["namespace"])
        obs = Observed(external_redis=bool(job.spec.weight_sync.redis.external_url))
        return _Pass(body, job, names, stored, prev, generation, now, full, obs)

    def _stopped_by_preflight(self, step: _Pass) -> bool:
        """Run the checks the schema cannot make (on spec changes, full passes and while one
        failed); a failed check settles the pass: hold, fail, or report the running gang."""
        failing = any(c.type == "Ready" and c.reason in PREFLIGHT_REASONS for c in step.prev.conditions)
        if not (step.full or step.spec_changed or failing):
            return False
        reason, message = self._preflight(step.job)
        if not reason:
            return False
        gang = self.kube.get("batch/v1", "Job", step.names.namespace, step.names.trainer)
        outcome = preflight_outcome(reason, gang is not None)
        if outcome == "hold":
            self._hold(step.body, step.stored, step.generation, reason, message, step.now)
            return True
        step.obs.preflight_reason, step.obs.preflight_message = reason, message
        if outcome == "fail":
            self._delete_gang(step.names)  # gang objects without a Job: nothing may be left holding resources
            decision = TrainerDecision("fail", reason, message)
        else:
            decision = decide_trainer(step.job, step.prev, step.obs, step.now, lambda _: 0)
        st = compute_status(step.job, step.generation, step.prev, step.obs, decision, 0, None, None, step.now)
        self._write_status(step.body, step.stored, st)
        return True

    def _apply_children(
        self, step: _Pass, decision: TrainerDecision, desired: int, *, rescale: bool
    ) -> tuple[TrainerDecision, tuple[str, str] | None]:
        """Render and apply the children, the gang only when the decision (re)creates or updates
        it, and delete a gang the decision ends. Returns the decision as carried out (a gang still
        going holds its successor back) and (reason, message) when the pass must hold instead."""
        job, obs, names = step.job, step.obs, step.names
        plan = RenderPlan(
            uid=step.body["metadata"]["uid"],
            rollout_replicas=desired,
            trainers_suspended=job.spec.suspend,
            operator_namespace=self.settings.namespace,
            keda_namespace=self.settings.keda_namespace,
            workload_api=self._workload_api(),
        )
        children = render_children(job, plan)
        trainer = [c for c in children if c["kind"] in TRAINER_KINDS]
        others = [c for c in children if c["kind"] not in TRAINER_KINDS]
        creating = obs.trainer_job is None
        # A gang about to be (re)created gets every child it reads first (its headless Service,
        # the ConfigMap); other deletions are found by a periodic look at the children.
        missing = (
            obs.rollout is None
            or (not obs.external_redis and obs.redis is None)
            or (creating and decision.action == "apply")
            or (not step.full and self._child_deleted(others, names, not obs.external_redis, step.now))
        )
        apply_trainer = decision.action == "apply" and (creating or step.full or step.spec_changed)
        if apply_trainer and creating and self._gang_terminating(trainer):
            # The previous gang's objects are still going (a PodGroup waits for its pods): a new
            # Job must not join a group that is about to vanish. Try again next pass.
            decision = TrainerDecision("wait", "GangRestarting", "waiting for the previous gang objects to go")
            apply_trainer = False
        everything = step.full or missing or step.spec_changed
        held = self._apply(step, others, trainer if apply_trainer else [], everything=everything, rescale=rescale)
        if held:
            return decision, held
        if not apply_trainer and decision.action in ("restart", "delete", "fail"):
            self._delete_gang(names)
        if decision.action in ("restart", "fail") and decision.failed_uid:
            prom.GANG_RESTARTS.inc()
        return decision, None

    def _report(self, step: _Pass, decision: TrainerDecision, st: RLJobStatus, desired: int) -> None:
        """Status, the restart event and the job's gauges."""
        prev, job = step.prev, step.job
        if prev.rollout_replicas_desired is not None and desired != prev.rollout_replicas_desired:
            st.last_scale_time = iso(step.now)
        if decision.action == "restart":
            message = f"{decision.message}; restarting all trainers (restart {st.restarts}/{job.spec.restart_limit})"
            self.post_event(step.body, "Warning", "GangRestart", message)
        ns, name = step.names.namespace, step.names.job
        prom.JOB_STEP.labels(ns, name).set(st.step or 0)
        prom.JOB_REWARD.labels(ns, name).set(st.mean_reward or 0.0)
        prom.ROLLOUT_DESIRED.labels(ns, name).set(desired)
        self._write_status(step.body, step.stored, st)

    def _observe_children(self, job: RLJob, names: ChildNames, obs: Observed) -> None:
        """Read the children the pass decides on: the trainer Job and its pods, the rollout
        Deployment, Kueue's verdict on the gang and the managed Redis StatefulSet."""
        ns = names.namespace
        obs.trainer_job = self.kube.get("batch/v1", "Job", ns, names.trainer)
        obs.trainer_pods = self.kube.list("v1", "Pod", ns, f"rljob.dev/job={names.job},rljob.dev/role=trainer")
        obs.rollout = self.kube.get("apps/v1", "Deployment", ns, names.rollout)
        obs.quota_reservation = self._quota_reservation(job, obs.trainer_job)
        if not obs.external_redis:
            obs.redis = self.kube.get("apps/v1", "StatefulSet", ns, names.redis)

    def _observe_redis(
        self, job: RLJob, *, full: bool, final: bool
    ) -> tuple[TrainerMetrics | None, int | None, str | None]:
        """(metrics, backlog, error). Full passes (spec changes) only apply children and report what
        the last timer pass read; timer passes read Redis. The pass that records a finished job
        (`final`) reads its last metrics even while the backoff after a Redis blip runs: the status
        it writes stays as it is from then on."""
        if full:
            memory = self.memory(job.metadata.namespace, job.metadata.name)
            error = None if memory.last_metrics is not None else memory.last_redis_error
            return memory.last_metrics, None, error
        return self._read_redis(job, retry_now=final)

    def _apply(
        self, step: _Pass, others: list[Manifest], trainer: list[Manifest], *, everything: bool, rescale: bool
    ) -> tuple[str, str] | None:
        """Apply the children of this pass: every child but the gang when `everything` (a spec
        change, a child missing), else only the rollout Deployment when its replicas change; then
        the gang's objects, when given. Returns (reason, message) when the pass must hold instead.

        All or nothing: a child the API server refuses (an immutable field, an admission policy, a
        quota on Jobs, a gang webhook) must not leave the others on the new spec and the rest on
        the old one, nor workers and Redis running for a gang never created: a dry run of them all
        comes first."""
        job, names = step.job, step.names
        if everything:
            held = self._refusal(others + self._dry_runnable(trainer))
            if not held and not job.spec.weight_sync.redis.external_url:
                held = self._ensure_secret(job, step.body["metadata"]["uid"])
            if held:
                return held
            for manifest in others:
                self.kube.apply(manifest)
            if job.spec.rollout.autoscaler != "keda" and self._api_available(KEDA_API):
                # Switched away from KEDA: its HPA must stop writing replicas.
                for kind in ("ScaledObject", "TriggerAuthentication"):
                    self.kube.delete(KEDA_API, kind, names.namespace, names.rollout)
        elif rescale:
            held = self._refusal([c for c in others if c["kind"] == "Deployment"], dry_run=False)
            if held:
                return held
        # A refusal here: the dry run let it through, the API server did not (a quota used meanwhile).
        return self._refusal(trainer, dry_run=False)

    def _refusal(self, manifests: list[Manifest], *, dry_run: bool = True) -> tuple[str, str] | None:
        """("ApplyRejected", why) when the API server refuses one of `manifests` (applied in order;
        a dry run by default), else None. Only a refusal of the request itself counts; anything
        else (conflicts, throttling, server errors) raises, and the pass is retried."""
        for manifest in manifests:
            try:
                self.kube.apply(manifest, dry_run=dry_run)
            except ApiError as exc:
                if _refused(exc):
                    return "ApplyRejected", _refusal_message(manifest, exc)
                raise
        return None

    def _dry_runnable(self, trainer: list[Manifest]) -> list[Manifest]:
        """The trainer manifests a dry run can judge. A Workload PodGroup names its Workload, and
        the API server refuses it while that does not exist, which a dry run of the Workload does
        not change: it is checked only once its Workload exists (else by the apply itself)."""
        out = []
        for manifest in trainer:
            ref = referenced_workload(manifest) if manifest["kind"] == "PodGroup" else None
            ns = manifest["metadata"]["namespace"]
            if ref and self.kube.get(manifest["apiVersion"], "Workload", ns, ref) is None:
                continue
            out.append(manifest)
        return out

    def _hold(
        self, body: dict[str, Any], stored: RLJobStatus, generation: int, reason: str, message: str, now: float
    ) -> None:
        """Apply nothing of this generation; say why in Ready (and once as an event)."""
        st = held_status(stored, generation, reason, message, now)
        ready = next((c for c in stored.conditions if c.type == "Ready"), None)
        if ready is None or (ready.reason, ready.message) != (reason, message):
            self.post_event(body, "Warning", reason, message)
        self._write_status(body, stored, st)

    def _gang_terminating(self, trainer: list[Manifest]) -> bool:
        for manifest in trainer:
            if manifest["kind"] == "Job":
                continue
            meta = manifest["metadata"]
            found = self.kube.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
            if found is not None and found["metadata"].get("deletionTimestamp"):
                return True
        return False

    def _delete_gang(self, names: ChildNames) -> None:
        """The trainer Job first, then the gang objects of every provider this cluster serves, not
        only the current one's: after a `gangProvider` switch the old provider's must go too."""
        self.kube.delete("batch/v1", "Job", names.namespace, names.trainer)
        for api_version, kind in GANG_KINDS:
            if self._api_available(api_version):
                self.kube.delete(api_version, kind, names.namespace, names.trainer)

    def _api_available(self, api_version: str) -> bool:
        hit = self._api_cache.get(api_version)
        if hit and time.time() - hit[1] < 60:
            return hit[0]
        ok = self.kube.api_available(api_version)
        self._api_cache[api_version] = (ok, time.time())
        return ok

    def _kueue_api(self) -> str | None:
        return next((api for api in KUEUE_APIS if self._api_available(api)), None)

    def _quota_reservation(self, job: RLJob, trainer_job: dict[str, Any] | None) -> dict[str, Any] | None:
        """Kueue's QuotaReserved condition for a queued trainer Job it has not admitted yet (one
        list of the namespace's Kueue Workloads by the Job's UID; none once the Job runs)."""
        if not job.spec.queue_name or trainer_job is None or not trainer_job["spec"].get("suspend"):
            return None
        api = self._kueue_api()
        by_uid = f"{JOB_UID_LABEL}={trainer_job['metadata']['uid']}"
        found = self.kube.list(api, "Workload", job.metadata.namespace, by_uid) if api else []
        return quota_reservation(found[0]) if found else None

    def _workload_api(self) -> str:
        """The newest Workload API version the cluster serves (the oldest if it serves none: a
        job that needs one is stopped by the preflight check before anything is rendered)."""
        return next((api for api in WORKLOAD_APIS if self._api_available(api)), WORKLOAD_APIS[-1])

    def _preflight(self, job: RLJob) -> tuple[str | None, str]:
        """Checks the schema cannot make; on failure nothing is created (no half-built job)."""
        ns = job.metadata.namespace
        provider = job.spec.trainer.gang_provider
        apis = PROVIDER_APIS.get(provider, ())
        if apis and not any(self._api_available(api) for api in apis):
            needs = " or ".join(apis)
            return "GangProviderUnavailable", f"trainer.gangProvider {provider} needs {needs}, which this cluster lacks"
        if job.spec.queue_name and self._kueue_api() is None:
            kueue = " or ".join(KUEUE_APIS)
            return "KueueUnavailable", f"spec.queueName needs Kueue ({kueue}), which this cluster lacks"
        if job.spec.rollout.autoscaler == "keda" and not self._api_available(KEDA_API):
            return "KedaUnavailable", f"rollout.autoscaler keda needs {KEDA_API} (install KEDA)"
        secret = job.spec.weight_sync.redis.password_secret
        if job.spec.weight_sync.redis.external_url and secret and self.kube.get("v1", "Secret", ns, secret) is None:
            return "RedisSecretNotFound", f"weightSync.redis.passwordSecret {secret} not found in {ns}"
        for field_name, claim in (
            ("trainer.checkpointVolumeClaim", job.spec.trainer.checkpoint_volume_claim),
            ("data.volumeClaim", job.spec.data.volume_claim),
        ):
            if claim and self.kube.get("v1", "PersistentVolumeClaim", ns, claim) is None:
                return "VolumeClaimNotFound", f"{field_name} {claim} not found in {ns}"
        return None, ""

    def _child_deleted(self, others: list[Manifest], names: ChildNames, managed: bool, now: float) -> bool:
        """Every `child_check_seconds`: whether a child this pass did not read (all but the rollout
        Deployment and the Redis StatefulSet) is gone, so the pass re-applies them all."""
        memory = self.memory(names.namespace, names.job)
        if now < memory.next_child_check:
            return False
        memory.next_child_check = now + self.settings.child_check_seconds
        wanted = [(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in others]
        if managed:
            wanted.append(("v1", "Secret", names.redis_secret))
        return any(
            self.kube.get(api, kind, names.namespace, name) is None
            for api, kind, name in wanted
            if kind not in ("Deployment", "StatefulSet")
        )

    def _ensure_secret(self, job: RLJob, uid: str) -> tuple[str, str] | None:
        """Create the Redis Secret if absent and remember its password. Returns (reason, message)
        when the pass must wait: the API server refused the Secret (a quota, a policy), or one of
        that name belongs to someone else, a deleted RLJob of the same name whose children the
        garbage collector has not removed yet. Adopting it would hand this job a password that
        disappears with it."""
        memory = self.memory(job.metadata.namespace, job.metadata.name)
        names = ChildNames(job.metadata.name, job.metadata.namespace)
        found = self.kube.get("v1", "Secret", names.namespace, names.redis_secret)
        memory.password = None  # until the Secret is found to be this job's
        if found is None:
            secret = render_redis_secret(job, RenderPlan(uid=uid, rollout_replicas=0), pysecrets.token_urlsafe(32))
            try:
                self.kube.create(secret)
            except ApiError as exc:
                if not _refused(exc):
                    raise
                return "ApplyRejected", _refusal_message(secret, exc)  # the API server's words, no value
            found = self.kube.get("v1", "Secret", names.namespace, names.redis_secret)
        if found is None:
            return "SecretNotOwned", f"Secret {names.redis_secret} was deleted as it was created; trying again"
        if not controlled_by(found, uid):
            return "SecretNotOwned", (
                f"Secret {names.redis_secret} belongs to another owner (a deleted RLJob of the same name?); "
                "waiting for it to be deleted"
            )
        memory.password = _secret_password(found)
        return None

    def _password(self, job: RLJob) -> str:
        memory = self.memory(job.metadata.namespace, job.metadata.name)
        if memory.password is None:
            secret = self.kube.get("v1", "Secret", job.metadata.namespace, redis_password_secret(job))
            if secret is None:
                return ""  # not created yet: nothing to remember (_ensure_secret creates it)
            memory.password = _secret_password(secret)
        return memory.password

    def _read_redis(self, job: RLJob, retry_now: bool = False) -> tuple[TrainerMetrics | None, int | None, str | None]:
        """Metrics and backlog; an unreachable Redis becomes a condition message, never a crash."""
        memory = self.memory(job.metadata.namespace, job.metadata.name)
        if not retry_now and time.time() < memory.redis_retry_at:
            return None, None, memory.last_redis_error or "RedisUnreachable"
        password = ""
        try:
            import redis

            password = self._password(job)
            timeout = self.settings.redis_timeout_seconds
            client = redis.Redis.from_url(
                redis_url(job), password=password or None, socket_connect_timeout=timeout, socket_timeout=timeout
            )
            try:
                keys = JobKeys(job.metadata.namespace, job.metadata.name)
                raw = client.hgetall(keys.metrics)
                backlog = pending_prompts(client, keys)
            finally:
                client.close()
        except Exception as exc:  # any Redis or DNS failure degrades to a condition
            message = f"{type(exc).__name__}: {exc}"
            if password:
                message = message.replace(password, "***")
            memory.redis_failed(message, time.time())
            return None, None, message
        metrics = TrainerMetrics.from_redis(raw) if raw else None
        memory.redis_read(metrics)
        return metrics, backlog, None

    def _write_status(self, body: dict[str, Any], prev: RLJobStatus, st: RLJobStatus) -> None:
        old = prev.model_dump(by_alias=True, mode="json", exclude_none=True)
        new = st.model_dump(by_alias=True, mode="json", exclude_none=True)
        if old == new:
            return
        patch: dict[str, Any] = {**dict.fromkeys(old), **new}  # a merge patch deletes fields set to null
        if st.phase != prev.phase:
            detail = failed_condition(st) or next((c for c in st.conditions if c.type == "Ready"), None)
            preflight = st.phase == "Pending" and detail and detail.reason in PREFLIGHT_REASONS
            kind = "Warning" if st.phase == "Failed" or preflight else "Normal"
            message = f"{prev.phase or 'New'} -> {st.phase}" + (f": {detail.message}" if detail else "")
            self.post_event(body, kind, f"Phase{st.phase}", message)
        meta = body["metadata"]
        try:
            self.kube.patch_status(meta["namespace"], meta["name"], patch)
        except ApiError as exc:
            if exc.status != 404:
                raise

    def _invalid(
        self, body: dict[str, Any], prev: RLJobStatus, generation: int, now: float, exc: ValidationError
    ) -> None:
        """A spec the schema let through but the model refuses (a CRD older than the operator, say).
        A job that never ran fails with InvalidSpec (and starts over once the spec is replaced); one
        that ran keeps running on its last valid spec (or stays finished), its Ready condition saying
        what is wrong."""
        message = invalid_spec_message(exc)
        if prev.phase and (prev.phase not in TERMINAL or failed_reason(prev) != "InvalidSpec"):
            if prev.phase not in TERMINAL:
                message += "; still running the previous spec"
            self._hold(body, prev, generation, "InvalidSpec", message, now)
            return
        decision = TrainerDecision("fail", "InvalidSpec", message)
        st = compute_status(RLJob(), generation, prev, Observed(), decision, 0, None, None, now)
        self._write_status(body, prev, st)

    def _finished(self, body: dict[str, Any], job: RLJob, prev: RLJobStatus, now: float) -> None:
        """Succeeded or Failed: rollout workers go away; the RLJob goes after its TTL."""
        ns, name = job.metadata.namespace, job.metadata.name
        names = ChildNames(name, ns)
        plan = RenderPlan(uid=body["metadata"]["uid"], rollout_replicas=0, operator_namespace=self.settings.namespace)
        if job.spec.rollout.autoscaler == "keda":
            # Paused at zero, or KEDA's HPA would scale the workers back to minReplicaCount.
            scaled = self.kube.get(KEDA_API, "ScaledObject", ns, names.rollout)
            if scaled is not None and scaled["metadata"].get("annotations", {}).get(KEDA_PAUSED) != "0":
                for manifest in render_keda(job, plan):
                    self.kube.apply(manifest)
        if prev.phase == "Failed":
            # Whatever failed the job, no trainer may keep holding its GPUs.
            gang = self.kube.get("batch/v1", "Job", ns, names.trainer)
            if gang is not None and not gang["metadata"].get("deletionTimestamp"):
                self._delete_gang(names)
        rollout = self.kube.get("apps/v1", "Deployment", ns, names.rollout)
        if rollout and rollout.get("spec", {}).get("replicas"):
            self.kube.apply(render_rollout_deployment(job, plan))
        self._write_status(body, prev, finished_rollouts(prev, rollout))  # patches only a change
        ttl = job.spec.ttl_seconds_after_finished
        done = parse_time(prev.completion_time)
        if ttl is not None and done is not None and now >= done + ttl:
            self.kube.delete(RLJOB_API, "RLJob", ns, name, propagation="Background")


def _stored_status(body: dict[str, Any]) -> RLJobStatus:
    """The status the RLJob holds; an unreadable one (written by another version) reads as empty."""
    try:
        return RLJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return RLJobStatus()


def _secret_password(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret.get("data", {}).get("password", "")).decode()


def _refused(exc: ApiError) -> bool:
    """The API server refused the request itself (invalid, forbidden by a policy): retrying the
    same request cannot help. Conflicts, throttling and server errors are not refusals."""
    return 400 <= exc.status < 500 and exc.status not in (404, 409, 429)


def _refusal_message(manifest: dict[str, Any], exc: ApiError) -> str:
    return f"{manifest['kind']} {manifest['metadata']['name']}: {exc.message}"


def invalid_spec_message(exc: ValidationError) -> str:
    """'spec.<field path>: <what is wrong>' for the first error (the model's paths start at spec)."""
    first = exc.errors()[0]
    path = [str(part) for part in first["loc"]]
    if path and path[0] == "spec":
        path = path[1:]
    return f"{'.'.join(['spec', *path])}: {first['msg']}"
