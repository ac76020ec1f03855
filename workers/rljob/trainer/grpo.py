"""The GRPO update as an object that needs no Redis: groups in, one optimiser step out."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rljob.config import GRPOSpec
from rljob.protocol import TrajectoryGroup
from rljob.trainer.batch import MicroBatch, collate, prompt_micro_batches, shard, trainable_samples
from rljob.trainer.distributed import Gang, all_reduce_sum, sync_gradients
from rljob.trainer.logits import TokenLogprobs, masked_token_logprobs
from rljob.trainer.loss import aggregate, grpo_token_terms
from rljob.trainer.model import disable_dropout


@dataclass
class StepStats:
    """What one update did (sums over the whole gang)."""

    loss: float = 0.0
    sequences: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    degenerate_groups: int = 0
    empty_samples: int = 0
    grad_norm: float = 0.0
    clip_fraction: float = 0.0
    truncated_fraction: float = 0.0
    importance_weight: float = 0.0
    ratio: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    updated: bool = False  # False when no sample carried any signal
    train_seconds: float = 0.0


# StepStats field -> the TokenTerms field whose per-token mean it reports.
_TOKEN_STATS = {
    "clip_fraction": "clipped",
    "truncated_fraction": "truncated",
    "importance_weight": "is_weight",
    "ratio": "ratio",
    "kl": "kl",
    "entropy": "entropy",
}


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A reference policy: the model's current weights, never trained."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class GRPOTrainer:
    """fp32 master weights, AdamW, micro-batched accumulation and gradient sync over the gang.

    `compute_dtype` bf16 runs the model body under autocast; fp32 (the default) runs it as is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        spec: GRPOSpec,
        device: torch.device | str = "cpu",
        *,
        pad_token_id: int = 0,
        gang: Gang | None = None,
        temperature: float = 1.0,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        self.spec = spec
        self.gang = gang or Gang()
        self.pad_token_id = pad_token_id
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy samples are never trained on)")
        self.temperature = temperature
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.train()
        disable_dropout(self.model)  # the rollout engine samples without it
        if spec.gradient_checkpointing:
            self._enable_checkpointing()
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=spec.learning_rate, weight_decay=spec.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        self.updates = 0  # optimiser steps taken (steps without signal take none)
        # The body's forward and backward run under autocast to `compute_dtype` (bf16 where the hardware
        # is fast at it: rljob.precision); master weights, AdamW and the output layer stay fp32.
        self.autocast_dtype = None if compute_dtype == torch.float32 else compute_dtype

    def _enable_checkpointing(self) -> None:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ValueError(f"{type(self.model).__name__} does not support gradient checkpointing")
        if hasattr(self.model, "config"):
            self.model.config.use_cache = False

    def _token_logprobs(self, model: torch.nn.Module, mb: MicroBatch, entropy: bool = False) -> TokenLogprobs:
        # Behaviour log-probs are of softmax(logits / T): the ratio must compare like with like.
        return masked_token_logprobs(
            model, mb, temperature=self.temperature, autocast_dtype=self.autocast_dtype, entropy=entropy
        )

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, groups: Sequence[TrajectoryGroup], current_version: int) -> StepStats:
        """One optimiser step on `groups`, whose policy is `current_version` before the update.

        Every rank must call this with the same groups; each trains on its strided shard. The
        loss is normalised by the gang-wide token (or sequence) count, so the result does not
        depend on how many ranks or micro-batches share the work.
        """
        started = time.perf_counter()
        spec = self.spec
        selection = trainable_samples(
            groups,
            current_version=current_version,
            max_policy_lag=spec.max_policy_lag,
            scale_rewards=spec.scale_rewards,
        )
        stats = StepStats(
            dropped_stale=selection.dropped_stale,
            degenerate_groups=selection.degenerate_groups,
            empty_samples=selection.empty,
            sequences=len(selection.samples),
            tokens=sum(s.num_loss_tokens for s in selection.samples),
        )
        if not selection.samples:
            stats.train_seconds = time.perf_counter() - started
            return stats  # nothing to learn from: no step, so AdamW's momentum does not move us

        # A group's rows together, so each micro-batch computes their prompt once.
        mine = shard(selection.samples, self.gang.rank, self.gang.world_size)
        batches = [
            collate(mb, self.pad_token_id, self.device, share_prefix=True)
            for mb in prompt_micro_batches(mine, spec.micro_batch_size)
        ]
        sums = torch.zeros(1 + len(_TOKEN_STATS), dtype=torch.float64)
        ref_cache: list[torch.Tensor] | None = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_cache = [self._token_logprobs(self.ref_model, mb).logp for mb in batches]
        prox_cache: list[torch.Tensor] = []

        self.optimizer.zero_grad(set_to_none=True)
        for epoch in range(spec.epochs):
            for i, mb in enumerate(batches):
                sums += self._accumulate(mb, epoch, i, prox_cache, ref_cache, stats)
            sync_gradients(self.gang, self.params)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, spec.max_grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate
            self.optimizer.step()
            self.updates += 1
            self.optimizer.zero_grad(set_to_none=True)
        stats.grad_norm = float(grad_norm)
        stats.updated = True

        all_reduce_sum(self.gang, sums)
        tokens = max(stats.tokens * spec.epochs, 1)
        stats.loss = float(sums[0]) / spec.epochs
        for i, name in enumerate(_TOKEN_STATS, start=1):
            setattr(stats, name, float(sums[i]) / tokens)
        stats.train_seconds = time.perf_counter() - started
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"non-finite GRPO loss {stats.loss}")
        return stats

    def _accumulate(
        self,
        mb: MicroBatch,
        epoch: int,
        index: int,
        prox_cache: list[torch.Tensor],
        ref_cache: list[torch.Tensor] | None,
        stats: StepStats,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss, then its `_TOKEN_STATS` sums."""
        spec = self.spec
        scored = self._token_logprobs(self.model, mb, entropy=spec.entropy_coef > 0)
        logp, entropy = scored.logp, scored.entropy
        if epoch == 0:
            # The parameters have not moved yet: this forward pass *is* the proximal policy.
            prox_cache.append(logp.detach())
        terms = grpo_token_terms(
            logp,
            prox_cache[index],
            mb.behaviour_logp,
            mb.advantages,
            mb.mask,
            clip_epsilon=spec.clip_epsilon,
            ratio_cap=spec.importance_ratio_cap,
            ref_logp=ref_cache[index] if ref_cache is not None else None,
            kl_coef=spec.kl_coef,
            entropy=entropy,
            entropy_coef=spec.entropy_coef,
        )
        loss = aggregate(
            terms.loss,
            mb.mask,
            spec.loss_aggregation,
            total_tokens=float(stats.tokens),
            total_sequences=float(stats.sequences),
        )
        loss.backward()
        with torch.no_grad():
            token_sums = [float(getattr(terms, field).sum()) for field in _TOKEN_STATS.values()]
            return torch.tensor([float(loss), *token_sums], dtype=torch.float64)

    @property
    def learning_rate(self) -> float:
        """The rate of the next optimiser step: linear warm-up over `lrWarmupSteps`, then constant."""
        warmup = self.spec.lr_warmup_steps
        return self.spec.learning_rate * (min(1.0, (self.updates + 1) / warmup) if warmup else 1.0)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state.get("updates", 0))  # checkpoints before lrWarmupSteps did not count
