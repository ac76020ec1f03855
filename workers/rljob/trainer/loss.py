"""The GRPO objective on per-token log-probs: pure tensor functions, no model, no optimiser.

Three policies meet in the loss:

- the behaviour policy that sampled the tokens (its log-probs travel with each trajectory),
- the proximal policy: the trainer's parameters at the start of this step (`prox_logp`, detached;
  in the first epoch it equals the current forward pass, so it costs nothing),
- the current parameters being optimised (`logp`).

The clipped surrogate uses the ratio current / proximal, and the lag between the behaviour policy
and the proximal one is corrected by a truncated importance weight min(proximal / behaviour, cap)
(decoupled PPO, as in AReaL; TRL's truncated importance sampling correction is the same weight).
With `maxPolicyLag: 0` the weight absorbs the numerical gap between the rollout engine and the
trainer, and, with `topP < 1`, the nucleus cut: the engine records log-probs of the renormalised
nucleus, the trainer scores the full softmax(logits / T), so the weight is the nucleus mass (below
1) on every token. That is the right weight of the full policy against the sampling distribution,
but the `importance_weight` metric then reads below 1 without any lag. Truncation bounds the
variance a very stale sample can inject.

Masked positions (prompt, retrieved and injected tokens, padding) get exactly zero gradient: every
term goes through `torch.where` on the mask *before* any exp, so a masked position's arbitrary
behaviour log-prob (0.0 by protocol) can neither overflow nor leak a NaN into the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: beyond it a ratio means a broken sample, not a signal


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target token: logits [..., V] (already aligned with targets [...]).

    One fused log-softmax and pick (`cross_entropy`), whose backward is one pass over the
    vocabulary: a gather minus a `logsumexp` takes several, which shows on a 49k-way vocabulary.
    """
    logits = logits.float()
    flat = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return -flat.view(targets.shape)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution: logits [b, t, V] -> [b, t]."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy.

    Unbiased, always >= 0 and low variance for samples drawn from the policy. The log-ratio is
    clamped like the policy ratio's, so a broken sample cannot overflow the exp.
    """
    delta = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0


@dataclass
class TokenTerms:
    """Per-token pieces of the loss ([b, t] each; zero where the mask is 0)."""

    loss: torch.Tensor  # what gets aggregated and differentiated
    ratio: torch.Tensor  # current / proximal (detached)
    is_weight: torch.Tensor  # truncated proximal / behaviour (detached)
    clipped: torch.Tensor  # 1.0 where the clip took the gradient away
    truncated: torch.Tensor  # 1.0 where the importance weight hit its cap
    kl: torch.Tensor  # k3 estimate (zeros when no reference)
    entropy: torch.Tensor  # entropy (zeros when not computed)


def grpo_token_terms(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_epsilon: float,
    ratio_cap: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> TokenTerms:
    """Per-token GRPO loss.

    loss = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A) + kl_coef * k3 - entropy_coef * H
    with r = exp(logp - prox_logp), w = min(exp(prox_logp - behaviour_logp), ratio_cap) detached,
    and A the sequence's advantage ([b] or [b, t], broadcast over tokens).
    """
    mask = mask.bool()
    zeros = torch.zeros_like(logp)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)

    log_ratio = torch.where(mask, logp - prox_logp.detach(), zeros).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)

    log_w = torch.where(mask, prox_logp.detach() - behaviour_logp, zeros)
    log_cap = math.log(ratio_cap)
    is_weight = torch.exp(log_w.clamp(max=log_cap))
    loss = -is_weight * surrogate

    kl = zeros
    if ref_logp is not None:
        kl = k3_kl(torch.where(mask, logp, zeros), torch.where(mask, ref_logp.detach(), zeros))
        if kl_coef:
            loss = loss + kl_coef * kl
    ent = zeros
    if entropy is not None:
        ent = torch.where(mask, entropy, zeros)
        if entropy_coef:
            loss = loss - entropy_coef * ent

    loss = torch.where(mask, loss, zeros)
    fmask = mask.to(logp.dtype)
    # The clip removes the gradient where the clipped branch is the smaller one and r is outside.
    clipped = ((ratio * adv > clipped_ratio * adv) & mask).to(logp.dtype)
    truncated = ((log_w > log_cap) & mask).to(logp.dtype)
    return TokenTerms(
        loss=loss,
        ratio=(ratio * fmask).detach(),
        is_weight=(is_weight * fmask).detach(),
        clipped=clipped.detach(),
        truncated=truncated.detach(),
        kl=(kl * fmask).detach(),
        entropy=ent.detach(),
    )


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["token-mean", "sequence-mean"],
    *,
    total_tokens: float,
    total_sequences: float,
) -> torch.Tensor:
    """Reduce per-token losses of one micro-batch to its share of the step's loss.

    The normalisers are the step's totals (over every micro-batch and rank), so summing the
    micro-batches' gradients over the gang gives exactly the full-batch mean, however the batch
    was split.
    """
    fmask = mask.to(token_loss.dtype)
    if mode == "token-mean":
        return (token_loss * fmask).sum() / max(total_tokens, 1.0)
    if mode == "sequence-mean":
        per_seq = (token_loss * fmask).sum(-1) / fmask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(total_sequences, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")
