"""Submitting a job through Kueue (`spec.queueName`): what the children carry, and what a wait means.

Kueue admits the trainer Job as one workload (every member's requests at once, or nothing) by
unsuspending it; its webhook suspends the Job when it is created, so the operator never writes
`spec.suspend` of a queued Job (it would let the gang start past the queue, or stop an admitted
one). Each rollout pod is a workload of its own (Kueue's Deployment integration), admitted as quota
allows, so a pool that grows queues its new workers one by one. The job's Redis is not queued.
"""

from __future__ import annotations

from typing import Any

from rljob.config import RLJob

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on the Workload Kueue makes for a Job
# Kueue's API, newest first (0.17 serves v1beta2; older releases v1beta1).
KUEUE_APIS = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")


def queue_labels(job: RLJob) -> dict[str, str]:
    """The label that hands a child to Kueue; none for a job that is not queued."""
    return {QUEUE_LABEL: job.spec.queue_name} if job.spec.queue_name else {}


def quota_reservation(workload: dict[str, Any] | None) -> dict[str, Any] | None:
    """The QuotaReserved condition of a Kueue Workload (None until Kueue has looked at it)."""
    for cond in (workload or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "QuotaReserved":
            return cond
    return None


def queued(
    job: RLJob, trainer_job: dict[str, Any] | None, reservation: dict[str, Any] | None
) -> tuple[str, str] | None:
    """(reason, message) while the trainer gang waits for Kueue, else None (pure).

    `QuotaExceedsQueue` when the gang asks for more than the ClusterQueue could ever give (Kueue
    says "maximum capacity"), so the job is not left waiting in silence for what cannot come."""
    if not job.spec.queue_name or job.spec.suspend or trainer_job is None:
        return None
    if not trainer_job.get("spec", {}).get("suspend"):
        return None  # admitted
    where = f"LocalQueue {job.spec.queue_name}"
    if reservation is None or reservation.get("status") == "True":
        return "Queued", f"waiting for Kueue to admit the trainer gang ({where})"
    said = reservation.get("message", "")
    if "maximum capacity" in said:
        return "QuotaExceedsQueue", f"the trainer gang can never fit in {where}'s ClusterQueue: {said}"
    return "Queued", f"waiting in {where}: {said}"
