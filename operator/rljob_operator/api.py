"""The RLJob status: written only by the operator, so it lives here and not in the shared model.

Conditions follow `metav1.Condition` (type, status, reason, message, lastTransitionTime,
observedGeneration) so `kubectl wait --for=condition=Ready` and generic tooling work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rljob.config import ApiModel

Phase = Literal["Pending", "Queued", "Initializing", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(ApiModel):
    """One observation about the job, in the `metav1.Condition` shape."""

    type: str = Field(description="Condition type, e.g. Ready, TrainersReady, Complete, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str = Field(description="When the status last changed (RFC 3339).")
    observed_generation: int = Field(0, description="The .metadata.generation this was computed for.")


class RLJobStatus(ApiModel):
    """Observed state of an RL training job."""

    phase: Phase | None = Field(
        None,
        description=(
            "Pending, Queued (Kueue has not admitted the trainer gang), Initializing, Running, Succeeded, Failed "
            "or Suspended."
        ),
    )
    conditions: list[Condition] = Field(default_factory=list, description="Latest observations of the job's state.")
    observed_generation: int | None = Field(None, description="The .metadata.generation last reconciled.")
    step: int | None = Field(None, description="Optimiser steps finished.")
    total_steps: int | None = Field(None, description="Steps the job will run.")
    policy_version: int | None = Field(None, description="Latest published weight version.")
    mean_reward: float | None = Field(None, description="Mean reward of the last training step.")
    eval_exact_match: float | None = Field(None, description="Exact match on held-out questions at the last eval.")
    eval_f1: float | None = Field(None, description="Token F1 on held-out questions at the last eval.")
    last_step_seconds: float | None = Field(None, description="Wall time of the last training step.")
    weight_bytes_last_step: int | None = Field(None, description="Bytes published to the weight store last step.")
    groups_generated: int | None = Field(None, description="Trajectory groups generated for training so far.")
    groups_dropped: int | None = Field(
        None, description="Of them, groups without signal (all rewards equal), generated but not trained on."
    )
    restarts: int = Field(0, description="Gang restarts so far (kept here so no child cleanup resets it).")
    last_restart_time: str | None = Field(None, description="When the gang was last restarted after a failure.")
    counted_failure_uid: str | None = Field(
        None, description="UID of the trainer Job whose failure was last counted (counts each failure once)."
    )
    rollout_replicas_desired: int | None = Field(None, description="Rollout workers the autoscaler wants.")
    rollout_replicas_ready: int | None = Field(None, description="Rollout workers ready.")
    rollouts: str | None = Field(None, description="Ready/desired rollout workers, for `kubectl get`.")
    last_scale_time: str | None = Field(None, description="When the operator's autoscaler last changed replicas.")
    trainer_template_hash: str | None = Field(None, description="Hash of the trainer gang's inputs now running.")
    start_time: str | None = Field(None, description="When the job first ran.")
    completion_time: str | None = Field(None, description="When the job succeeded or failed.")
