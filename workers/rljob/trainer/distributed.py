"""The trainer gang's process group: rendezvous from the operator's environment, gradient sync.

The operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (an Indexed Job gives
JOB_COMPLETION_INDEX instead of RANK). Two groups: the main one (nccl on GPU, gloo on CPU) with a
short collective timeout, so a dead member fails the step loudly and the operator restarts the
gang; and a gloo control group with a long timeout for handing the step's batch from rank 0 to the
others, since they legitimately wait as long as the rollouts take.

The rendezvous has the long timeout too: members start as far apart as their image pulls, which
the operator bounds (`trainer.scheduleTimeoutSeconds`), not the collective timeout. Phases whose
length differs by rank (loading the model, a checkpoint) end with a barrier on the control group,
so a collective on the main group waits only for compute, never for a slow disk or download.

Gradients are summed with explicit all-reduces rather than DDP: shards may differ in size (and be
empty) after stale and degenerate samples are dropped, which DDP's per-backward hooks cannot
tolerate, and the loss is already normalised by the step's global token count.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
CONTROL_TIMEOUT_S = 24 * 3600.0


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


def init_gang(device: torch.device) -> Gang:
    """Join the gang (env:// rendezvous) or return a single-process gang when WORLD_SIZE is 1.

    RANK (or JOB_COMPLETION_INDEX) and WORLD_SIZE come from the environment; neither set: a lone process.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK") or os.environ.get("JOB_COMPLETION_INDEX") or "0")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid gang position: RANK={rank} WORLD_SIZE={world_size}")
    if world_size == 1:
        return Gang()
    collective_timeout_s = float(os.environ.get("RLJOB_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # The env:// store (rank 0 serves it at MASTER_ADDR:MASTER_PORT) with the long timeout for
        # members: init_process_group's own would wait only the collective timeout.
        store = dist.TCPStore(
            host_name=os.environ["MASTER_ADDR"],
            port=int(os.environ["MASTER_PORT"]),
            world_size=world_size,
            is_master=rank == 0,
            timeout=dt.timedelta(seconds=CONTROL_TIMEOUT_S),
            wait_for_workers=True,
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=dt.timedelta(seconds=collective_timeout_s),
        )
    control = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=CONTROL_TIMEOUT_S))
    return Gang(rank=rank, world_size=world_size, control_group=control, collective_device=device.type)


def close_gang(gang: Gang, *, finished: bool = False) -> None:
    """Leave the process group. After a clean finish (`finished`) wait for every rank first, so no
    rank exits, closing its gloo connections (and on rank 0 the rendezvous store), while a peer
    still uses them: that can abort the peer at exit. After a failure, do not wait: a peer may be
    dead."""
    if gang.distributed and dist.is_initialized():
        if finished:
            try:
                control_barrier(gang)
            except RuntimeError as exc:  # a peer left early: this rank's work is done all the same
                log.warning("trainer rank %d: a peer left before the gang closed (%s)", gang.rank, exc)
        dist.destroy_process_group()


def broadcast_object(gang: Gang, obj: Any) -> Any:
    """Rank 0's `obj` on every rank, through the long-timeout control group."""
    if not gang.distributed:
        return obj
    box = [obj if gang.is_main else None]
    dist.broadcast_object_list(box, src=0, group=gang.control_group)
    return box[0]


def control_barrier(gang: Gang) -> None:
    """Wait, with the long timeout, for every rank: ends a phase whose length differs by rank."""
    if gang.distributed:
        dist.barrier(group=gang.control_group)


def all_ranks(gang: Gang, flag: bool) -> bool:
    """True when `flag` holds on every rank (control group)."""
    if not gang.distributed:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=gang.control_group)
    return bool(value.item())


def broadcast_state(gang: Gang, state: Any) -> Any:
    """Rank 0's nested state (dicts, lists, tuples of tensors) on every rank, tensor by tensor.

    Unlike `broadcast_object`, nothing pickles the tensors (that held about four copies of the state
    at once): the layout goes as a small object, then each tensor into a buffer of its own, on the
    control group (CPU; long timeout, as rank 0 may still be reading).
    """
    if not gang.distributed:
        return state
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _TensorSlot:  # a tensor's shape and dtype; the tensor goes after the layout
        tensors.append(t)
        return _TensorSlot(tuple(t.shape), t.dtype)

    def receive(slot: _TensorSlot) -> torch.Tensor:
        t = torch.empty(slot.shape, dtype=slot.dtype)
        dist.broadcast(t, src=0, group=gang.control_group)
        return t

    layout = broadcast_object(gang, _replace(state, torch.Tensor, slot) if gang.is_main else None)
    if gang.is_main:
        for t in tensors:
            dist.broadcast(t.detach().cpu().contiguous(), src=0, group=gang.control_group)
        return state
    return _replace(layout, _TensorSlot, receive)


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _replace(value: Any, leaf: type, fn: Callable[[Any], Any]) -> Any:
    """`value` with `fn` applied to each `leaf` in it, depth first in insertion order.

    Mappings are shallow-copied, so a state_dict stays an OrderedDict with its `_metadata`;
    a tensor anywhere else (a custom container) would be pickled with the layout.
    """
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _replace(v, leaf, fn)
        return out
    if type(value) in (list, tuple):
        return type(value)(_replace(v, leaf, fn) for v in value)
    return value


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
