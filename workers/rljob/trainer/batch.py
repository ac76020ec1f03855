"""From trajectory groups to padded tensors: advantages, stale drops, sharding, micro-batches.

Everything here is deterministic in the order of the groups it is given, so every rank that gets
the same groups builds the same sample list and takes its own slice of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rljob.protocol import Trajectory, TrajectoryGroup
from rljob.trainer.advantages import group_advantages, is_degenerate

# Fewer shared leading tokens than this are not worth a forward of their own.
MIN_SHARED_PREFIX = 8


@dataclass(frozen=True)
class Sample:
    """One trajectory with its advantage, ready to collate."""

    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float

    @property
    def num_loss_tokens(self) -> int:
        # Token 0 is never predicted, so it can never carry loss.
        return sum(self.loss_mask[1:])


@dataclass
class Selection:
    """What a step trains on, and what it left out and why."""

    samples: list[Sample]
    dropped_stale: int  # trajectories older than the allowed policy lag
    degenerate_groups: int  # groups whose rewards were all equal (no signal)
    empty: int  # trajectories without a single generated token


def fresh_trajectories(group: TrajectoryGroup, current_version: int, max_policy_lag: int) -> list[Trajectory]:
    """The group's trajectories whose policy is at most `max_policy_lag` versions behind."""
    return [t for t in group.trajectories if t.policy_version >= current_version - max_policy_lag]


def informative_groups(groups: Sequence[TrajectoryGroup], current_version: int, max_policy_lag: int) -> int:
    """Groups that will carry a gradient, as `trainable_samples` decides: fresh rewards not all equal."""
    return sum(
        not is_degenerate([t.reward for t in fresh_trajectories(g, current_version, max_policy_lag)]) for g in groups
    )


def trainable_samples(
    groups: Sequence[TrajectoryGroup],
    *,
    current_version: int,
    max_policy_lag: int,
    scale_rewards: bool,
) -> Selection:
    """Drop stale trajectories, compute group-relative advantages, drop signal-free groups.

    Stale trajectories leave their group before the advantages are computed, so the baseline is
    the mean over the samples actually trained on.
    """
    samples: list[Sample] = []
    dropped = degenerate = empty = 0
    for group in groups:
        fresh = fresh_trajectories(group, current_version, max_policy_lag)
        dropped += len(group.trajectories) - len(fresh)
        rewards = [t.reward for t in fresh]
        if is_degenerate(rewards):
            degenerate += 1 if fresh else 0
            continue
        for traj, adv in zip(fresh, group_advantages(rewards, scale=scale_rewards), strict=True):
            sample = Sample(
                token_ids=list(traj.token_ids),
                loss_mask=list(traj.loss_mask),
                behaviour_logprobs=list(traj.behaviour_logprobs),
                advantage=adv,
            )
            if sample.num_loss_tokens == 0:
                empty += 1
                continue
            samples.append(sample)
    return Selection(samples=samples, dropped_stale=dropped, degenerate_groups=degenerate, empty=empty)


def shard(samples: Sequence[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's samples: a strided slice, so shards differ in size by at most one."""
    return list(samples[rank::world_size])


def micro_batches(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    """Consecutive runs of at most `size` samples, in the order given."""
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def first_generated(sample: Sample) -> int:
    """Index of the sample's first generated token: the tokens before it are its prompt."""
    return next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.token_ids))


def prompt_micro_batches(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    """Micro-batches of samples that share a prompt (a group's), longest first within each.

    Rows of one prompt together let `collate` share their prefix (computed once a micro-batch);
    longest first keeps rows of like length padding together. The loss is normalised by the
    step's whole token (or sequence) count, so the grouping changes nothing but float rounding.
    """
    by_prompt: dict[tuple[int, ...], list[Sample]] = {}
    for sample in samples:
        by_prompt.setdefault(tuple(sample.token_ids[: first_generated(sample)]), []).append(sample)
    out: list[list[Sample]] = []
    for group in by_prompt.values():
        out += micro_batches(sorted(group, key=lambda s: -len(s.token_ids)), size)
    return out


def shared_prefix_length(samples: Sequence[Sample]) -> int:
    """Leading tokens every sample has in common and that predict no loss token, or 0 when fewer
    than `MIN_SHARED_PREFIX` or a single sample (nothing to share).

    The last shared position stays out, so that each row's own forward starts at the position
    whose logits predict its first generated token.
    """
    if len(samples) < 2:
        return 0
    head, length = samples[0].token_ids, max(min(first_generated(s) for s in samples) - 1, 0)
    for s in samples[1:]:
        length = next((i for i in range(length) if s.token_ids[i] != head[i]), length)
    return length if length >= MIN_SHARED_PREFIX else 0


@dataclass
class MicroBatch:
    """Right-padded tensors; everything after `input_ids` is aligned with the predicted tokens.

    Position j of `targets`, `mask` and `behaviour_logp` describes token j+1 of the sequence,
    predicted from the logits at position j.
    """

    input_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    targets: torch.Tensor  # [b, T-1]
    mask: torch.Tensor  # [b, T-1] bool: generated tokens only
    behaviour_logp: torch.Tensor  # [b, T-1] float32
    advantages: torch.Tensor  # [b] float32
    # Leading tokens all rows share that predict no loss token (a group's prompt): the forward
    # may compute them once for the micro-batch (`logits.masked_token_logprobs`). 0 = none.
    shared_prefix: int = 0


def collate(
    samples: Sequence[Sample], pad_token_id: int, device: torch.device | str = "cpu", *, share_prefix: bool = False
) -> MicroBatch:
    """Pad a micro-batch on the right and shift labels by one; with `share_prefix`, note the
    prefix the rows share (`shared_prefix_length`)."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    width = max(len(s.token_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    old = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old[i, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets=ids[:, 1:].to(device),
        mask=mask[:, 1:].to(device),
        behaviour_logp=old[:, 1:].to(device),
        advantages=adv.to(device),
        shared_prefix=shared_prefix_length(samples) if share_prefix else 0,
    )
