"""The RLJob API: one pydantic model that is the single source of truth.

The CRD in `crds/` is generated from these classes (`rljob_operator.crd`), the operator renders
children from them, and the workers read the same model back from the job ConfigMap. Field names
are camelCase aliases so the YAML a user writes is what Kubernetes users expect, while Python code
uses snake_case. This module imports nothing heavy: both images load it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "rljob.dev"
API_VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """A CEL validation rule for the CRD (`x-kubernetes-validations`)."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


@dataclass(frozen=True)
class Rule:
    """A cross-field rule written once: `cel` for the API server (in the CRD, so `kubectl apply`
    refuses), `holds` for this model (so a local run refuses the same specs), one message for both."""

    cel: str
    message: str
    holds: Callable[[Any], bool]
    field_path: str | None = None


def validations(rules: Sequence[Rule], *transition_rules: dict[str, str]) -> dict[str, Any]:
    """A model's `x-kubernetes-validations`: its rules' CEL, then rules only the API server can check
    (transition rules on `oldSelf`)."""
    return {"x-kubernetes-validations": [cel(r.cel, r.message, r.field_path) for r in rules] + list(transition_rules)}


class ApiModel(BaseModel):
    """Base: camelCase on the wire, unknown fields refused so typos fail loudly; `RULES` checked."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True)
    RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        for rule in self.RULES:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self


class ModelSpec(ApiModel):
    """Which policy model to train."""

    name: str = Field(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        min_length=1,
        description="Hub name or local path of the policy model (a directory, or a .gguf file).",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside `name` when the model ships as GGUF (dequantised on load)."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description=(
            "Dtype the policy computes in: the rollout engine's weights and the trainer's autocast (its master "
            "weights and AdamW stay fp32). `auto`: bf16 on GPUs and on CPUs with native bf16 matrix products "
            "(AVX512_BF16, AMX, Arm BF16), fp32 on other CPUs."
        ),
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")


class DataSpec(ApiModel):
    """Where questions and the retrieval corpus come from (HotpotQA layout)."""

    source: Literal["path", "hub"] = Field(
        "path", description="`path`: JSON or JSON Lines files on a volume; `hub`: a dataset on the hub."
    )
    train_path: str = Field(
        "/data/hotpotqa/train.jsonl", min_length=1, description="Training questions (path or hub split)."
    )
    eval_path: str = Field(
        "/data/hotpotqa/dev.jsonl", min_length=1, description="Held-out questions, never trained on."
    )
    corpus_from: Literal["train", "train+eval"] = Field(
        "train+eval",
        description="Which questions' context paragraphs form the BM25 corpus (one passage per title).",
    )
    max_train_questions: int | None = Field(None, ge=1, description="Use only the first N train questions.")
    volume_claim: str | None = Field(
        None, description="PersistentVolumeClaim mounted read-only at /data in every worker (data, local models)."
    )
    seed: int = Field(0, ge=0, description="Seed for shuffling the training questions.")
    validation_questions: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Training questions set aside as a validation slice that neither the warm-up nor RL uses "
            "(`rljob eval --split validation` scores it): choose settings there, never on the evaluation set."
        ),
    )


class AgentSpec(ApiModel):
    """The Search-R1 style multi-turn protocol."""

    max_turns: int = Field(4, ge=1, le=16, description="Most model turns per question (searches + answer).")
    top_k: int = Field(3, ge=1, le=20, description="Passages returned per search.")
    max_new_tokens_per_turn: int = Field(64, ge=8, le=4096, description="Token budget of one model turn.")
    max_total_tokens: int = Field(
        1024, ge=64, le=32768, description="Budget for the whole trajectory, prompt included."
    )
    passage_max_words: int = Field(60, ge=8, le=1000, description="Passages are cut to this many words.")
    temperature: float = Field(
        1.0,
        gt=0.0,
        le=2.0,
        description="Sampling temperature for rollouts; must be > 0: GRPO learns from differences within a "
        "group, and greedy (T=0) samples make every group identical, so no step would update the policy.",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold for rollouts.")
    format_reward: float = Field(0.0, ge=0.0, le=1.0, description="Bonus for a well-formed answer tag (0 disables it).")
    search_reward: float = Field(0.0, ge=0.0, le=1.0, description="Bonus for making at least one search.")
    reward: Literal["em", "f1"] = Field("em", description="Main reward: exact match or token F1.")

    RULES = (
        Rule(
            "self.maxNewTokensPerTurn < self.maxTotalTokens",
            "maxNewTokensPerTurn must be smaller than maxTotalTokens",
            lambda a: a.max_new_tokens_per_turn < a.max_total_tokens,
        ),
    )
    model_config = ConfigDict(json_schema_extra=validations(RULES))


class GRPOSpec(ApiModel):
    """GRPO hyper-parameters (names follow TRL's GRPOConfig where they overlap)."""

    group_size: int = Field(8, ge=2, le=256, description="Samples per question (G); advantages are group-relative.")
    questions_per_step: int = Field(4, ge=1, le=4096, description="Questions per optimiser step (B).")
    learning_rate: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    kl_coef: float = Field(0.0, ge=0.0, le=10.0, description="KL penalty to the frozen reference (k3 estimator).")
    clip_epsilon: float = Field(0.2, gt=0.0, le=1.0, description="PPO-style clip range of the ratio.")
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0, description="Entropy bonus coefficient.")
    scale_rewards: bool = Field(True, description="Divide advantages by the group's std.")
    loss_aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "token-mean", description="How per-token losses are averaged."
    )
    micro_batch_size: int = Field(8, ge=1, le=4096, description="Sequences per forward/backward pass.")
    epochs: int = Field(1, ge=1, le=16, description="Passes over each step's batch.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Optimiser steps before the job succeeds.")
    max_policy_lag: int = Field(
        0, ge=0, le=16, description="Samples may come from policies at most this many versions old (0: synchronous)."
    )
    importance_ratio_cap: float = Field(
        2.0, ge=1.0, le=100.0, description="Truncation of the behaviour-policy importance weight when lagging."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    checkpoint_interval: int = Field(10, ge=1, description="Steps between trainer checkpoints.")
    seed: int = Field(0, ge=0, description="Trainer seed.")
    lr_warmup_steps: int = Field(
        0, ge=0, le=1_000_000, description="Linear learning-rate warm-up over the first N optimiser steps (TRL)."
    )
    answerable_only: bool = Field(
        False,
        description=(
            "Draw RL prompts only from questions whose gold answer appears in what the retriever returns for "
            "the question itself (agent.topK passages of agent.passageMaxWords words, the warm-up's check): "
            "on the others every sample scores 0, the group is dropped, and its rollouts were paid for."
        ),
    )
    max_questions: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description=(
            "Train on at most this many RL questions (the first of the RL pool, after answerableOnly); a small "
            "pool comes back every epoch, so the training reward compares the same questions over time. "
            "Unset: the whole pool."
        ),
    )
    dynamic_sampling: bool = Field(
        False,
        description=(
            "DAPO's dynamic sampling: while fewer than questionsPerStep of a step's groups are informative "
            "(rewards not all equal), ask for more prompts, up to maxRefillRounds rounds."
        ),
    )
    max_refill_rounds: int = Field(3, ge=0, le=100, description="Most extra prompt rounds a step asks for.")

    RULES = (
        Rule(
            "self.microBatchSize <= self.groupSize * self.questionsPerStep",
            "microBatchSize must not exceed groupSize * questionsPerStep",
            lambda g: g.micro_batch_size <= g.group_size * g.questions_per_step,
        ),
    )
    model_config = ConfigDict(json_schema_extra=validations(RULES))


class ResourceSpec(ApiModel):
    """Per-pod resources; GPUs are requested as `nvidia.com/gpu`."""

    cpu: str = Field("1", pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request and limit.")
    memory: str = Field("4Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)?$", description="Memory request and limit.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs per pod (nvidia.com/gpu).")


_TRAINER_ONE_GPU = "a trainer pod runs one rank on one GPU: use trainer.replicas for more GPUs"


class RolloutSpec(ApiModel):
    """The autoscaled rollout Deployment."""

    image: str = Field("ghcr.io/rljob/rljob-workers:0.1.0", min_length=1, description="Worker image.")
    engine: Literal["vllm", "hf"] = Field("hf", description="Generation engine: vLLM on GPUs, transformers elsewhere.")
    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest rollout workers.")
    max_replicas: int = Field(4, ge=1, le=1000, description="Most rollout workers.")
    pending_per_replica: int = Field(
        8, ge=1, le=100_000, description="Pending prompts one worker should carry; the autoscaling target."
    )
    autoscaler: Literal["operator", "keda"] = Field(
        "operator", description="`operator`: built-in timer on stream lag; `keda`: a KEDA ScaledObject."
    )
    scale_down_cooldown_seconds: int = Field(60, ge=0, le=86400, description="Wait before scaling down again.")
    batch_size: int = Field(4, ge=1, le=4096, description="Prompts a worker takes at once.")
    resources: ResourceSpec = Field(default_factory=ResourceSpec)

    RULES = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must be <= maxReplicas",
            lambda r: r.min_replicas <= r.max_replicas,
            ".minReplicas",
        ),
        Rule(
            "self.engine != 'vllm' || self.resources.gpus >= 1",
            "engine vllm needs resources.gpus >= 1",
            lambda r: r.engine != "vllm" or r.resources.gpus >= 1,
            ".engine",
        ),
        Rule(
            "self.engine == 'vllm' || self.resources.gpus <= 1",
            "engine hf serves from one GPU per pod: use engine vllm (tensor parallel over the pod's GPUs) "
            "or more replicas",
            lambda r: r.engine == "vllm" or r.resources.gpus <= 1,
            ".resources.gpus",
        ),
    )
    model_config = ConfigDict(json_schema_extra=validations(RULES))


class TrainerSpec(ApiModel):
    """The all-or-nothing trainer gang."""

    image: str = Field("ghcr.io/rljob/rljob-workers:0.1.0", min_length=1, description="Trainer image.")
    replicas: int = Field(1, ge=1, le=1024, description="Trainer pods; all start or none do.")
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    gang_provider: Literal["workload", "volcano", "coscheduling", "none"] = Field(
        "workload",
        description="Gang scheduler: Kubernetes' Workload API, Volcano, scheduler-plugins coscheduling, or none.",
    )
    schedule_timeout_seconds: int = Field(
        600, ge=10, le=86400, description="How long the gang may wait to be scheduled before the job fails."
    )
    checkpoint_volume_claim: str | None = Field(
        None, description="PersistentVolumeClaim for checkpoints; an emptyDir (lost on restart) when unset."
    )
    scheduler_name: str | None = Field(
        None,
        description=(
            "Scheduler for trainer pods. Unset: `volcano` for the volcano provider, "
            "`scheduler-plugins-scheduler` for coscheduling, the default scheduler otherwise."
        ),
    )

    RULES = (Rule("self.resources.gpus <= 1", _TRAINER_ONE_GPU, lambda t: t.resources.gpus <= 1, ".resources.gpus"),)
    model_config = ConfigDict(json_schema_extra=validations(RULES))


# redis:// or rediss://, optional user info, a host name or bracketed IPv6 address, an optional
# port and an optional database number: what the workers, the operator and KEDA all parse the same way.
EXTERNAL_URL_PATTERN = r"^rediss?://([^@/?#]*@)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?(/[0-9]{1,5})?/?$"
_IMMUTABLE_VOLUME = "the managed Redis volume (persistence, storage) cannot change once created; create a new RLJob"


class RedisSpec(ApiModel):
    """Managed Redis for the job, or an external one."""

    external_url: str | None = Field(
        None,
        pattern=EXTERNAL_URL_PATTERN,
        description="Use this Redis instead of a managed one (password from a Secret): "
        "`redis://` or `rediss://`, a host, an optional port and an optional database number.",
    )
    password_secret: str | None = Field(
        None, min_length=1, description="Secret (key `password`) holding the external Redis password."
    )
    image: str = Field("redis:7.4-alpine", min_length=1, description="Managed Redis image.")
    memory: str = Field("2Gi", pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$", description="Managed Redis memory limit.")
    # The StatefulSet's volume claim template cannot change once created: both are immutable.
    persistence: bool = Field(
        True,
        description="Append-only file on a PersistentVolumeClaim (deleted with the RLJob). Immutable.",
        json_schema_extra={"x-kubernetes-validations": [cel("self == oldSelf", _IMMUTABLE_VOLUME)]},
    )
    storage: str = Field(
        "10Gi",
        pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$",
        description="Size of the persistence volume. Immutable.",
        json_schema_extra={"x-kubernetes-validations": [cel("self == oldSelf", _IMMUTABLE_VOLUME)]},
    )

    @field_validator("external_url")
    @classmethod
    def _port_in_range(cls, url: str | None) -> str | None:
        # The pattern checks the shape; the port's range is easier said here (reported as InvalidSpec).
        if url is not None:
            port = urlsplit(url).port  # raises ValueError out of 0-65535
            if port == 0:
                raise ValueError("port 0 is not a Redis port")
        return url


class WeightSyncSpec(ApiModel):
    """How new policy versions reach the rollout workers."""

    mode: Literal["delta", "full"] = Field(
        "delta", description="`delta`: changed bf16 values only; `full`: every version whole."
    )
    rebase_interval: int = Field(20, ge=1, le=10_000, description="Write a new full export every K versions.")
    rebase_fraction: float = Field(
        0.5, gt=0.0, le=4.0, description="Rebase when the delta chain since the last full exceeds this fraction of it."
    )
    chunk_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024, description="Largest Redis value written (bytes)."
    )
    redis: RedisSpec = Field(
        default_factory=RedisSpec,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.externalUrl) == has(oldSelf.externalUrl)",
                    "switching between managed and external Redis is not allowed; create a new RLJob",
                )
            ]
        },
    )

    RULES = (
        Rule(
            "!has(self.redis) || !has(self.redis.externalUrl) || has(self.redis.passwordSecret)",
            "an external Redis needs passwordSecret",
            lambda w: not w.redis.external_url or bool(w.redis.password_secret),
            ".redis",
        ),
    )
    model_config = ConfigDict(json_schema_extra=validations(RULES))


class EvalSpec(ApiModel):
    """Periodic greedy evaluation on held-out questions."""

    interval: int = Field(10, ge=0, description="Steps between evaluations (0 disables them).")
    questions: int = Field(100, ge=1, le=100_000, description="Held-out questions per evaluation.")
    split: Literal["eval", "validation"] = Field(
        "eval",
        description=(
            "What the trainer's evaluations score: `eval`, the evaluation set (data.evalPath); `validation`, "
            "the validation slice of the training questions (data.validationQuestions), for choosing settings "
            "without looking at the evaluation set."
        ),
    )


class WarmupSpec(ApiModel):
    """Optional supervised warm-up on protocol demonstrations before the first RL step.

    A small model rarely follows the search/answer protocol on its own, so RL gets almost no
    signal. Demonstrations are built from training questions only (search, the retriever's real
    results, the gold answer); the loss covers only the tokens the model would write.
    """

    enabled: bool = Field(False, description="Run the warm-up once, before policy version 0 is published.")
    examples: int = Field(
        256, ge=1, le=1_000_000, description="Demonstrations to build (train questions whose answer is retrieved)."
    )
    epochs: int = Field(1, ge=1, le=100, description="Passes over the demonstrations.")
    learning_rate: float = Field(5e-5, gt=0.0, le=1.0, description="AdamW learning rate of the warm-up.")
    batch_size: int = Field(4, ge=1, le=4096, description="Demonstrations per optimiser step.")
    max_searches: int = Field(
        2, ge=1, le=15, description="Most searches per demonstration (a 2nd looks up a missing supporting title)."
    )
    seed: int = Field(0, ge=0, description="Seed for the order of the demonstrations.")
    question_pool: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description=(
            "Training questions reserved for the warm-up: demonstrations come only from them and RL never "
            "samples them. Default 2 x examples (about half of the questions give a demonstration), at most "
            "half of the training questions outside the validation slice."
        ),
    )


class RLJobSpec(ApiModel):
    """Desired state of an RL training job."""

    model: ModelSpec = Field(
        default_factory=ModelSpec,
        json_schema_extra={
            "x-kubernetes-validations": [cel("self == oldSelf", "spec.model is immutable; create a new RLJob")]
        },
    )
    data: DataSpec = Field(
        default_factory=DataSpec,
        json_schema_extra={
            "x-kubernetes-validations": [cel("self == oldSelf", "spec.data is immutable; create a new RLJob")]
        },
    )
    agent: AgentSpec = Field(default_factory=AgentSpec)
    grpo: GRPOSpec = Field(default_factory=GRPOSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    queue_name: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description=(
            "Kueue LocalQueue (in this namespace) that admits the trainer gang (whole or not at all) and the "
            "rollout pods (each on its own); they carry its name as label kueue.x-k8s.io/queue-name. "
            "Unset: not queued. Immutable."
        ),
    )
    suspend: bool = Field(False, description="Delete pods but keep state; resume by setting false.")
    restart_limit: int = Field(3, ge=0, le=1000, description="Gang restarts allowed before the job fails.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it succeeds or fails."
    )

    RULES = (
        Rule(
            "!has(self.eval) || !has(self.eval.split) || self.eval.split != 'validation'"
            " || (has(self.data) && has(self.data.validationQuestions) && self.data.validationQuestions > 0)",
            "eval.split validation scores the validation slice: set data.validationQuestions (200 or more gives "
            "settings a fair test), or eval.split eval",
            lambda spec: spec.eval.split != "validation" or spec.data.validation_questions > 0,
            ".eval.split",
        ),
        Rule(
            "!has(self.rollout) || !has(self.model) || !has(self.rollout.engine)"
            " || self.rollout.engine != 'vllm' || !has(self.model.ggufFile)",
            "rollout.engine vllm cannot serve model.ggufFile: vLLM's quantized GGUF layers take no weight "
            "updates; use the unquantized checkpoint, or engine hf (which dequantises on load)",
            lambda spec: spec.rollout.engine != "vllm" or not spec.model.gguf_file,
            ".rollout.engine",
        ),
    )
    model_config = ConfigDict(
        json_schema_extra=validations(
            RULES,
            cel(
                "has(self.queueName) == has(oldSelf.queueName)"
                " && (!has(self.queueName) || self.queueName == oldSelf.queueName)",
                "spec.queueName is immutable: a queued gang cannot move between queues; create a new RLJob",
                ".queueName",
            ),
        )
    )


class ObjectMeta(ApiModel):
    """The part of metadata the workers need."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)
    name: str = "local"
    namespace: str = "default"


class RLJob(ApiModel):
    """A whole RLJob manifest (what `kubectl apply -f` and `rljob run` read)."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)
    api_version: str = f"{API_GROUP}/{API_VERSION}"
    kind: Literal["RLJob"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RLJobSpec = Field(default_factory=RLJobSpec)


def load_rljob(path: str) -> RLJob:
    """Read an RLJob manifest from a YAML file (the first document whose kind is RLJob)."""
    import yaml

    with open(path, encoding="utf-8") as fh:
        for doc in yaml.safe_load_all(fh):
            if isinstance(doc, dict) and doc.get("kind") == KIND:
                return RLJob.model_validate(doc)
    raise ValueError(f"{path}: no document with kind: {KIND}")
