"""The trainer gang's process group: rendezvous from the operator's environment, gradient sync.

The operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (an Indexed Job gives
JOB_COMPLETION_INDEX instead of RANK). Two groups: the main one (nccl on GPU, gloo on CPU) with a
short collective timeout, so a dead member fails the step loudly and the operator restarts the
gang; and a gloo control group with a long timeout for handing the step's batch from rank 0 to the
others, since they legitimately wait as long as the rollouts take.

Gradients are summed with explicit all-reduces rather than DDP: shards may differ in size (and be
empty) after stale and degenerate samples are dropped, which DDP's per-backward hooks cannot
tolerate, and the loss is already normalised by the step's global token count.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
DEFAULT_CONTROL_TIMEOUT_S = 24 * 3600.0


@dataclass
class Gang:
    """Where this process stands in the gang; `world_size == 1` means no process group at all."""

    rank: int = 0
    world_size: int = 1
    control_group: Any = None  # gloo group for Python objects; None when single-process
    collective_device: str = "cpu"  # nccl reduces only CUDA tensors

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_and_world_from_env(env: dict[str, str] | None = None) -> tuple[int, int]:
    """RANK (or JOB_COMPLETION_INDEX) and WORLD_SIZE; a lone process when neither is set."""
    env = dict(os.environ) if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    rank_text = env.get("RANK") or env.get("JOB_COMPLETION_INDEX") or "0"
    rank = int(rank_text)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"invalid gang position: RANK={rank} WORLD_SIZE={world}")
    return rank, world


def init_gang(
    device: torch.device,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    collective_timeout_s: float | None = None,
    control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
) -> Gang:
    """Join the gang (env:// rendezvous) or return a single-process gang when WORLD_SIZE is 1."""
    env_rank, env_world = rank_and_world_from_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if world_size == 1:
        return Gang()
    if collective_timeout_s is None:
        collective_timeout_s = float(os.environ.get("RLJOB_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=dt.timedelta(seconds=collective_timeout_s),
        )
    control = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=control_timeout_s))
    return Gang(rank=rank, world_size=world_size, control_group=control, collective_device=device.type)


def close_gang(gang: Gang) -> None:
    if gang.distributed and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(gang: Gang, obj: Any) -> Any:
    """Rank 0's `obj` on every rank, through the long-timeout control group."""
    if not gang.distributed:
        return obj
    box = [obj if gang.is_main else None]
    dist.broadcast_object_list(box, src=0, group=gang.control_group)
    return box[0]


def all_reduce_sum(gang: Gang, tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over the gang (main group); a dead member raises after the collective timeout."""
    if gang.distributed:
        moved = tensor.to(gang.collective_device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        tensor.copy_(moved)
    return tensor


def sync_gradients(gang: Gang, params: Iterable[torch.nn.Parameter]) -> None:
    """Sum gradients over the gang in one flat buffer (missing grads count as zeros)."""
    if not gang.distributed:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_parameters(gang: Gang, module: torch.nn.Module) -> None:
    """Make every rank start from rank 0's weights (and buffers)."""
    if not gang.distributed:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)
