"""Writing decoded bf16 values into live tensors, in place (the model's storage is never replaced).

Targets are bf16 or fp32 tensors on any device; bf16 -> fp32 is exact, so an fp32 target holds
exactly the published bf16 values. Models are addressed by `named_parameters()`, which lists a
tied weight (SmolLM2's lm_head / embed_tokens) once, the same way the publisher names them.
A delta is decoded straight into the tensors' own memory and touches only the changed elements;
`apply_stream` returns the change sum (`checksum.change_sum`) of what the targets held before and
hold after, for the reader to compare with the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np
import torch

from rljob.weights.checksum import change_sum_of_parts
from rljob.weights.codec import DeltaFormatError, EncodedDelta, decode_positions, decode_steps, ulp_unzigzag
from rljob.weights.parallel import TensorPool

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def named_tensors(source: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor, with the naming publisher and reader share."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    return dict(source.items())


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"weights must be bf16 or fp32 to receive bf16 values, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("weights must be contiguous to be updated in place")
    return tensor.detach().view(-1)


def _patterns_at(flat: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """In torch, on `flat`'s device: the int16 bf16 patterns at `index` (all when None). An fp32
    target holds bf16 values exactly, so its upper 16 bits are the pattern (NaN payloads too)."""
    picked = flat if index is None else flat[index]
    if picked.dtype == torch.float32:
        return (picked.view(torch.int32) >> 16).to(torch.int16)
    return picked.view(torch.int16)


def _write_patterns(flat: torch.Tensor, index: torch.Tensor | None, patterns: torch.Tensor) -> None:
    """In torch: write int16 bf16 `patterns` at `index` of `flat` (all when None); an fp32 target
    gets the pattern as its upper 16 bits, lower zero (the shift drops the sign extension)."""
    if flat.dtype == torch.bfloat16:
        memory, values = flat.view(torch.int16), patterns
    else:
        memory, values = flat.view(torch.int32), patterns.to(torch.int32) << 16
    with torch.no_grad():
        if index is None:
            memory.copy_(values)
        else:
            memory[index] = values


def gather_bits(tensor: torch.Tensor, positions: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """The bf16 patterns `tensor` holds at flat `positions` (all when None), as uint16, in `out`
    when given (fp32 targets: upper halves).

    On the CPU, `np.take` on a view of the tensor's memory, straight into `out`. Positions come
    from a decoder that checked their range; ``wrap`` spares take its per-index bounds branch.
    """
    flat = _flat(tensor)
    if flat.device.type != "cpu":
        index = None if positions is None else torch.from_numpy(positions).to(flat.device)
        picked = _patterns_at(flat, index).cpu().numpy().view(np.uint16)
        if out is None:
            return picked
        out[...] = picked
        return out
    count = flat.numel() if positions is None else positions.size
    out = np.empty(count, dtype=np.uint16) if out is None else out
    if flat.dtype == torch.bfloat16:
        memory = flat.view(torch.int16).numpy().view(np.uint16)
        if positions is None:
            np.copyto(out, memory)
        else:
            np.take(memory, positions, out=out, mode="wrap")
        return out
    words = flat.view(torch.int32).numpy().view(np.uint32)
    picked = words if positions is None else np.take(words, positions, mode="wrap")
    np.right_shift(picked, 16, out=out, casting="unsafe")
    return out


def scatter_bits(tensor: torch.Tensor, positions: np.ndarray | None, values: np.ndarray) -> None:
    """Write bf16 patterns `values` at flat `positions` of `tensor` (all when None), in place. An
    fp32 target holds each bf16 value exactly: upper 16 bits, lower zero.

    On the CPU, torch's `scatter_` on an integer view of the tensor (zero-copy from numpy).
    """
    flat = _flat(tensor)
    if flat.device.type != "cpu":
        index = None if positions is None else torch.from_numpy(positions).to(flat.device)
        _write_patterns(flat, index, torch.from_numpy(values.view(np.int16)).to(flat.device))
        return
    if flat.dtype == torch.bfloat16:
        memory, patterns = flat.view(torch.int16), torch.from_numpy(np.ascontiguousarray(values).view(np.int16))
    else:
        memory, patterns = flat.view(torch.int32), torch.from_numpy((values.astype(np.uint32) << 16).view(np.int32))
    with torch.no_grad():
        if positions is None:
            memory.copy_(patterns)
        else:
            memory.scatter_(0, torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)), patterns)


def apply_stream(
    tensors: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    enc: EncodedDelta,
    pool: TensorPool | None = None,
    *,
    in_torch: bool | None = None,
) -> tuple[int, list[int]]:
    """Apply one delta stream over tensors laid end to end (`sizes` elements each), in place.

    A tensor may be None where the stream changes nothing in it. The two streams decode once for
    the whole version (side by side on `pool`); only the gather of the old values and the scatter
    of the new ones run per tensor. Targets in device memory take `_gather_scatter_in_torch`
    (`in_torch`: None decides by the targets' device; True forces it, which tests run on CPU).
    Returns the change sum over the stream's positions (what the targets held before and hold
    now) and the indices of the tensors it changed.
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
    flats = {i: _flat(tensors[i]) for i, _, _ in parts}  # type: ignore[arg-type]
    touched = list(flats)
    for i, a, b in parts:  # positions local to each tensor, in place (no copy of the whole list)
        positions[a:b] -= offsets[i]
    starts = np.array([a for _, a, _ in parts], dtype=np.intp)
    part_offsets = np.array([offsets[i] for i, _, _ in parts], dtype=np.int64)
    if in_torch or (in_torch is None and any(flat.device.type != "cpu" for flat in flats.values())):
        old, new = _gather_scatter_in_torch(flats, parts, positions, steps)
        return change_sum_of_parts(positions, old, new, starts, part_offsets), touched
    old = np.empty(positions.size, dtype=np.uint16)

    def gather(part: tuple[int, int, int]) -> None:
        i, a, b = part
        gather_bits(tensors[i], positions[a:b], out=old[a:b])

    run(gather, parts, cost=lambda part: part[2] - part[1])
    new = ulp_unzigzag(old, steps)

    def scatter(part: tuple[int, int, int]) -> None:
        i, a, b = part
        scatter_bits(tensors[i], positions[a:b], new[a:b])

    run(scatter, parts, cost=lambda part: part[2] - part[1])
    return change_sum_of_parts(positions, old, new, starts, part_offsets), touched


def _gather_scatter_in_torch(
    flats: dict[int, torch.Tensor], parts: list[tuple[int, int, int]], positions: np.ndarray, steps: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Gather, decode and scatter for targets in device memory (one device for the stream).

    The positions cross to the device once, the old patterns come back once and the new ones go
    over once; every per-tensor gather and scatter is a device kernel. (Per tensor through
    `gather_bits` / `scatter_bits`, that was three small copies and a synchronisation for each
    changed tensor.) `flats` are the targets' flat views by tensor index. Returns the old and new
    patterns as host uint16, for the change sum.
    """
    device = flats[parts[0][0]].device
    if any(flat.device != device for flat in flats.values()):
        raise ValueError("the targets of one delta stream must share a device")
    index = torch.from_numpy(positions).to(device)
    old_patterns = torch.empty(positions.size, dtype=torch.int16, device=device)
    for i, a, b in parts:
        old_patterns[a:b] = _patterns_at(flats[i], index[a:b])
    old = old_patterns.cpu().numpy().view(np.uint16)
    new = ulp_unzigzag(old, steps)
    new_patterns = torch.from_numpy(new.view(np.int16)).to(device)
    for i, a, b in parts:
        _write_patterns(flats[i], index[a:b], new_patterns[a:b])
    return old, new


def write_full(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Copy bf16 `values` into `tensor` in place (shape must match)."""
    flat = _flat(tensor)
    if tuple(tensor.shape) != tuple(values.shape):
        raise ValueError(f"shape mismatch: target {tuple(tensor.shape)}, published {tuple(values.shape)}")
    with torch.no_grad():
        flat.copy_(values.reshape(-1))


def ensure_target(target: MutableMapping[str, torch.Tensor], name: str, values: torch.Tensor) -> None:
    """For a dict target: write into the existing tensor, or add a bf16 copy when the name is new."""
    if name in target:
        write_full(target[name], values)
    else:
        target[name] = values.clone()
