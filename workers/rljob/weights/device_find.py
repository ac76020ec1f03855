"""The publisher's find pass in torch, on whatever device holds the trainer's weights.

On a GPU trainer the masters live in device memory. Copying them to the host and comparing there
moves 2 bytes per parameter over PCIe and spends the host's memory bandwidth on the whole model
every version (about 1.1 ns per parameter on one core here, `benchmarks/bench_weight_pass.py`).
Comparing on the device instead reads the fp32 masters and a device copy of the published bf16
baseline at the accelerator's bandwidth, and only the changes (positions, old and new bit
patterns) cross to the host. The device copy costs 2 bytes per parameter of device memory, so it
is made only when it fits (`mirror_fits`); otherwise the publisher compares on the host.

The cast is torch's fp32 -> bf16 round to nearest even, the same conversion the host path and a
full export use, so a version's bits do not depend on where its changes were found.
"""

from __future__ import annotations

import numpy as np
import torch

from rljob.weights.changes import Changes

# Elements per block: bounds the temporaries (a bf16 cast and a bool mask, 3 bytes per element)
# to 192 MiB on the device, while each block is large enough to keep a GPU busy.
DEVICE_BLOCK = 1 << 26
# Keep this fraction of the device's free memory free after making the baseline's device copy.
_HEADROOM = 0.5


def mirror_fits(device: torch.device, nbytes: int) -> bool:
    """Whether a baseline copy of `nbytes` (plus one block of temporaries) fits in `device`'s free
    memory with headroom left for training. Always true for the CPU (the tests' stand-in)."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes + 3 * min(DEVICE_BLOCK, nbytes // 2) <= free * _HEADROOM


def device_baseline(bits: np.ndarray, device: torch.device) -> torch.Tensor:
    """A flat int16 copy of the host baseline `bits` (uint16) on `device`, owned by the caller."""
    host = torch.from_numpy(bits.view(np.int16))
    return host.to(device, copy=True)


def find_changes_torch(baseline: torch.Tensor, source: torch.Tensor, *, block: int = DEVICE_BLOCK) -> Changes:
    """Where `source` rounded to bf16 differs from `baseline` (a flat int16 tensor of bf16 bit
    patterns on the same device), with both sides' patterns there, as host numpy. `baseline` is
    advanced to the new patterns in place. Positions are int64, patterns uint16, as `find_changes`.
    """
    flat = source.detach().reshape(-1)
    if baseline.dtype != torch.int16 or baseline.dim() != 1:
        raise ValueError(f"baseline must be a flat int16 tensor, got {baseline.dtype} {tuple(baseline.shape)}")
    if baseline.numel() != flat.numel():
        raise ValueError(f"shape mismatch: baseline has {baseline.numel()} elements, source {flat.numel()}")
    if baseline.device != flat.device:
        raise ValueError(f"baseline is on {baseline.device}, source on {flat.device}")
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for start in range(0, flat.numel(), block):
            stop = min(start + block, flat.numel())
            piece = flat[start:stop]
            new = (piece if piece.dtype == torch.bfloat16 else piece.to(torch.bfloat16)).view(torch.int16)
            old = baseline[start:stop]
            hit = torch.nonzero(new != old).squeeze(1)
            if hit.numel():
                was, now = old[hit], new[hit]
                old[hit] = now
                found.append((hit + start, was, now))
    if not found:
        return Changes(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.uint16))
    positions, old, new = (torch.cat(parts).cpu().numpy() for parts in zip(*found, strict=True))
    return Changes(positions.astype(np.int64, copy=False), old.view(np.uint16), new.view(np.uint16))
