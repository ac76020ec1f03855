"""Writing decoded bf16 values into live tensors, in place (the model's storage is never replaced).

Targets are bf16 or fp32 tensors on any device; bf16 -> fp32 is exact, so an fp32 target holds
exactly the published bf16 values. Models are addressed by `named_parameters()`, which lists a
tied weight (SmolLM2's lm_head / embed_tokens) once, the same way the publisher names them.
A delta is decoded straight into the tensors' own memory and touches only the changed elements;
`apply_stream` returns the change sum (`checksum.change_sum`) of what the targets held before and
hold after, for the reader to compare with the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from rljob.weights.checksum import change_sum
from rljob.weights.codec import DeltaFormatError, EncodedDelta, decode_positions, decode_steps, ulp_unzigzag
from rljob.weights.parallel import TensorPool


def named_tensors(source: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor, with the naming publisher and reader share."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    return dict(source.items())


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"weights must be bf16 or fp32 to receive bf16 values, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("weights must be contiguous to be updated in place")
    return tensor.detach().view(-1)


def gather_bits(tensor: torch.Tensor, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The bf16 patterns `tensor` holds at flat `positions`, as uint16, in `out` when given. An
    fp32 target holds bf16 values exactly, so its upper 16 bits are the pattern (NaN payloads too).
    The same torch ops on every device; only the result crosses to the host."""
    flat = _flat(tensor)
    out = np.empty(positions.size, dtype=np.uint16) if out is None else out
    index = torch.from_numpy(positions).to(flat.device)
    if flat.dtype == torch.bfloat16:
        picked = flat.view(torch.int16).index_select(0, index)
    else:
        picked = (flat.view(torch.int32).index_select(0, index) >> 16).to(torch.int16)
    torch.from_numpy(out.view(np.int16)).copy_(picked)
    return out


def scatter_bits(tensor: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
    """Write bf16 patterns `values` at flat `positions` of `tensor`, in place. An fp32 target gets
    each pattern as its upper 16 bits, lower zero (exactly the bf16 value)."""
    flat = _flat(tensor)
    patterns = torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).to(flat.device)
    if flat.dtype == torch.bfloat16:
        memory = flat.view(torch.int16)
    else:
        memory, patterns = flat.view(torch.int32), patterns.to(torch.int32) << 16  # the shift drops the sign
    index = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(flat.device)
    with torch.no_grad():
        memory.scatter_(0, index, patterns)


def apply_stream(
    tensors: Sequence[torch.Tensor | None], sizes: Sequence[int], enc: EncodedDelta, pool: TensorPool | None = None
) -> tuple[int, list[int]]:
    """Apply one delta stream over tensors laid end to end (`sizes` elements each), in place.

    A tensor may be None where the stream changes nothing in it. The two streams decode once for
    the whole version (side by side on `pool`); only the gather of the old values and the scatter
    of the new ones run per tensor. Returns the change sum over the stream's positions (what the
    targets held before and hold now) and the indices of the tensors it changed.
    """
    if enc.numel != sum(sizes):
        raise DeltaFormatError(f"delta stream is for {enc.numel} elements, the tensors have {sum(sizes)}")
    if enc.count == 0:
        return 0, []
    run = (pool or TensorPool(1)).map
    positions, steps = run(lambda decode: decode(enc), [decode_positions, decode_steps])
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    cuts = np.searchsorted(positions, offsets)
    parts = [(i, int(cuts[i]), int(cuts[i + 1])) for i in range(len(sizes)) if cuts[i + 1] > cuts[i]]
    for i, _, _ in parts:
        target = tensors[i]
        if target is None:
            raise ValueError(f"the delta stream changes tensor {i}, which has no target")
        if target.numel() != sizes[i]:
            raise ValueError(f"tensor {i} has {target.numel()} elements, the delta stream {sizes[i]}")
    old = np.empty(positions.size, dtype=np.uint16)

    def gather(part: tuple[int, int, int]) -> None:
        i, a, b = part
        gather_bits(tensors[i], positions[a:b] - offsets[i], out=old[a:b])

    run(gather, parts, cost=lambda part: part[2] - part[1])
    new = ulp_unzigzag(old, steps)

    def scatter(part: tuple[int, int, int]) -> None:
        i, a, b = part
        scatter_bits(tensors[i], positions[a:b] - offsets[i], new[a:b])

    run(scatter, parts, cost=lambda part: part[2] - part[1])
    return change_sum(positions, old, new), [i for i, _, _ in parts]


def write_full(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Copy bf16 `values` into `tensor` in place (the caller checked that the shapes match)."""
    flat = _flat(tensor)
    with torch.no_grad():
        flat.copy_(values.reshape(-1))
