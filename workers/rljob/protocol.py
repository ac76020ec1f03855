"""Messages that cross process boundaries through Redis streams.

The trainer puts `PromptRequest`s on the prompt stream; rollout workers answer each with one
`TrajectoryGroup` (G samples of the same question) on the trajectory stream. Each entry holds a
single field `data` with the model's JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Request ids of the trainer's eval prompts start with this, so the trainer can find what an eval
# round that timed out left in the workers' done set (rounds run one at a time, on rank 0).
EVAL_ID_PREFIX = "eval-"


class PromptRequest(BaseModel):
    """One question to be sampled `group_size` times."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(description="Unique per (step, question); dedupes redeliveries.")
    step: int = Field(ge=-1, description="Trainer step this prompt is for (-1: a standalone evaluation).")
    question_id: str
    question: str
    answers: list[str] = Field(description="Gold answers; any match counts.")
    group_size: int = Field(ge=1)
    min_policy_version: int = Field(
        0, ge=0, description="Workers must have at least this weight version loaded before sampling."
    )
    greedy: bool = Field(False, description="Eval prompts decode greedily.")

    @classmethod
    def for_question(cls, question: Any, request_id: str, **fields: Any) -> PromptRequest:
        """A request for a `rljob.data.Question`: its id, text and gold answers, plus `fields`."""
        answers = list(question.answers)
        return cls(
            request_id=request_id, question_id=question.id, question=question.question, answers=answers, **fields
        )


class Trajectory(BaseModel):
    """One multi-turn episode, ready for the loss."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(description="Prompt and every turn, model and injected tokens alike.")
    prompt_length: int = Field(ge=0, description="Tokens of the initial prompt (never trained on).")
    loss_mask: list[int] = Field(
        description="1 for tokens the policy generated, 0 for prompt and injected (retrieved) tokens."
    )
    behaviour_logprobs: list[float] = Field(
        description="Log-prob under the behaviour policy for each token (0.0 where loss_mask is 0)."
    )
    policy_version: int = Field(ge=0)
    searches: list[str] = Field(default_factory=list)
    answer: str | None = None
    reward: float = 0.0
    exact_match: float = 0.0
    f1: float = 0.0
    format_ok: bool = False
    num_turns: int = 0
    finish_reason: str = ""

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and behaviour_logprobs "
                f"({len(self.behaviour_logprobs)}) must have equal length"
            )
        return self


class TrajectoryGroup(BaseModel):
    """All samples of one prompt request; the unit of group-relative advantages."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    step: int
    question_id: str
    worker_id: str
    trajectories: list[Trajectory]
    generation_seconds: float = 0.0


class TrainerMetrics(BaseModel):
    """What the trainer writes to the job's metrics hash after each step (the operator reads it).

    Stored as a Redis hash of strings; `to_redis` / `from_redis` convert. Eval fields stay at their
    last values between evaluations.
    """

    model_config = ConfigDict(extra="ignore")

    state: str = Field("running", description="running | succeeded | failed")
    step: int = 0
    total_steps: int = 0
    policy_version: int = 0
    mean_reward: float = 0.0
    exact_match: float = 0.0
    f1: float = 0.0
    format_rate: float = 0.0
    searches_per_question: float = 0.0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    train_seconds: float = 0.0
    dropped_stale: int = 0
    groups_generated_total: int = 0  # trajectory groups generated for training (refills included)
    groups_dropped_total: int = 0  # of them, groups without signal (equal rewards), not trained on
    weight_bytes: int = 0
    eval_step: int = -1
    eval_exact_match: float | None = None
    eval_f1: float | None = None
    message: str = ""
    updated_at: float = 0.0

    def to_redis(self) -> dict[str, str]:
        return {k: ("" if v is None else str(v)) for k, v in self.model_dump().items()}

    @classmethod
    def from_redis(cls, raw: dict[bytes | str, bytes | str]) -> TrainerMetrics:
        decoded = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        # "" stands for None only in the optional fields; `message` is legitimately "".
        nullable = {name for name, f in cls.model_fields.items() if f.default is None}
        return cls.model_validate({k: (None if v == "" and k in nullable else v) for k, v in decoded.items()})
