"""Atomic trainer checkpoints: model, optimiser, step, policy version and every RNG state.

A checkpoint is written to a hidden temporary directory and renamed into place, so a crash mid-write
leaves the previous checkpoint as the latest; readers only ever see complete `step-NNNNNNNN` folders.

The KL reference policy is not in the checkpoints: it never changes during a run, so it is written
once, beside them (`reference.pt`), when the warm-up has made it differ from the base model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PREFIX = "step-"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
REFERENCE_FILE = "reference.pt"
KEEP = 2  # how many of the newest checkpoints `save_checkpoint` leaves


@dataclass(frozen=True)
class CheckpointRef:
    """Which checkpoint a gang resumes from: small enough to broadcast, unlike the state itself.

    `name` (the `step-NNNNNNNN` folder) is resolved against each rank's own checkpoint directory.
    """

    name: str
    step: int
    policy_version: int


@dataclass
class Checkpoint:
    step: int
    policy_version: int
    trainer: dict[str, Any]  # GRPOTrainer.state_dict()
    rng: dict[str, Any]


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    out = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir() and child.name.startswith(PREFIX) and (child / META_FILE).exists():
                try:
                    out.append((int(child.name[len(PREFIX) :]), child))
                except ValueError:
                    continue
    return sorted(out)


def save_checkpoint(directory: str | Path, *, step: int, policy_version: int, trainer_state: dict[str, Any]) -> Path:
    """Write `step-<step>` atomically, then keep only the newest `KEEP` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{step:08d}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    payload = {"trainer": trainer_state, "rng": capture_rng()}
    torch.save(payload, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps({"step": step, "policy_version": policy_version}, indent=1))
    for name in (STATE_FILE, META_FILE):
        _fsync(tmp / name)
    if final.exists():  # the same step written again (e.g. after a restart): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(directory)
    for _, old in _step_dirs(directory)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | Path) -> Path | None:
    dirs = _step_dirs(Path(directory))
    return dirs[-1][1] if dirs else None


def read_ref(path: str | Path) -> CheckpointRef:
    """Name and step of the checkpoint at `path`, from its small meta file."""
    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    return CheckpointRef(name=path.name, step=int(meta["step"]), policy_version=int(meta["policy_version"]))


def sees(directory: str | Path, ref: CheckpointRef) -> bool:
    """Whether this process sees checkpoint `ref`, whole, in `directory` (its own mount of the volume)."""
    path = Path(directory) / ref.name
    try:
        return read_ref(path) == ref and (path / STATE_FILE).is_file()
    except (OSError, ValueError, KeyError):
        return False


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> Checkpoint:
    """Read a checkpoint; `mmap` maps the file instead of reading it into anonymous memory.

    Mapped tensors are page cache, which the kernel can drop, so a resume that copies them onto a
    GPU never holds the state in process memory; a tensor kept past the copy keeps the file mapped.
    """
    ref = read_ref(path)
    # Our own file (RNG states include numpy arrays), so the full unpickler is fine here.
    payload = torch.load(Path(path) / STATE_FILE, map_location=map_location, weights_only=False, mmap=mmap)
    return Checkpoint(step=ref.step, policy_version=ref.policy_version, trainer=payload["trainer"], rng=payload["rng"])


def save_reference(directory: str | Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """Write the KL reference weights atomically (temporary file, fsync, rename) beside the checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / REFERENCE_FILE
    tmp = directory / f".tmp-{REFERENCE_FILE}-{os.getpid()}"
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, tmp)
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(directory)
    return final


def load_reference(directory: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor] | None:
    """The reference weights `save_reference` wrote, or None when this run has none."""
    path = Path(directory) / REFERENCE_FILE
    if not path.exists():
        return None
    return torch.load(path, map_location=map_location, weights_only=True)


def remove_reference(directory: str | Path) -> None:
    """Forget a previous run's reference: a fresh start must not resume against it later."""
    (Path(directory) / REFERENCE_FILE).unlink(missing_ok=True)
