"""How a gloo gang starts: resuming a checkpoint without copies of it, and members that start or load late.

Each test starts real trainer processes: this file doubles as their entry point (`python FILE ...`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rljob.config import RLJob
from rljob.ports import free_port
from rljob.trainer import loop
from rljob.trainer.checkpoint import STATE_FILE, save_checkpoint
from rljob.trainer.distributed import Gang, all_reduce_sum, close_gang, init_gang
from rljob.trainer.grpo import GRPOTrainer

JOB = {"spec": {"grpo": {"klCoef": 0.0, "groupSize": 4, "questionsPerStep": 2, "microBatchSize": 8}}}
BIG_VOCAB = 16_000  # ~8M parameters: a ~100 MB checkpoint with Adam moments, far above RSS noise
SMALL_VOCAB = 64


def _job() -> RLJob:
    return RLJob.model_validate(JOB)


def _model(vocab: int) -> torch.nn.Module:
    """Plain torch: what is tested is moving its state, and importing transformers costs ~10 s a process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Embedding(vocab, 256), torch.nn.Linear(256, vocab))


# -- the processes --------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+)", fh.read()).group(1))


def _slow(delay: float, fn: Any) -> Any:
    """`fn`, made `delay` seconds slower on rank 1 (a download, a cold disk)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("RANK") == "1":
            time.sleep(delay)
        return fn(*args, **kwargs)

    return wrapped


def _member(args: argparse.Namespace) -> None:
    """One trainer rank: start as prepare_trainer does, run one main-group collective, report."""
    torch.set_num_threads(1)
    model = _model(args.vocab)  # before measuring: the base model is there before any resume
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its first use imports ~150 MB of code
    loop.load_policy_model = _slow(args.load_delay, lambda job: model)
    loop.load_checkpoint = _slow(args.read_delay, loop.load_checkpoint)
    cpu = torch.device("cpu")
    print("joining", flush=True)
    gang = init_gang(cpu)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # peak RSS from here on
    before = _rss_kib("VmRSS")
    trainer, resumed = loop.prepare_trainer(_job(), gang, cpu, None, args.dir, progress=False)
    growth = (_rss_kib("VmHWM") - before) * 1024
    all_reduce_sum(gang, torch.ones(1))  # the first main-group collective, under the short timeout
    out = {"growth": growth, "step": resumed.step if resumed else None, "rng": torch.get_rng_state()}
    torch.save({**out, **_trainer_state(trainer)}, args.out)
    if args.closing_marker and gang.rank == 1:
        time.sleep(2)  # a peer still busy after the last collective (writing its results, say)
        Path(args.closing_marker).touch()
    close_gang(gang, finished=True)
    if args.closing_marker and gang.rank == 0:  # what rank 0 could see once its close returned
        Path(args.out).with_suffix(".closed").write_text(str(Path(args.closing_marker).exists()))


def _trainer_state(trainer: GRPOTrainer) -> dict[str, Any]:
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab", type=int, default=SMALL_VOCAB)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--read-delay", type=float, default=0.0)
    parser.add_argument("--closing-marker", default="")
    _member(parser.parse_args())


# -- the tests ------------------------------------------------------------------------------------


def _start(rank: int, port: int, directory: Path, out: Path, *extra: str, timeout_s: str = "300") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX"}}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        RLJOB_COLLECTIVE_TIMEOUT=timeout_s,
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, __file__, "--dir", str(directory), "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _save_checkpoint(directory: Path, vocab: int) -> Path:
    """A checkpoint after one optimiser step, so the Adam moments are there (two thirds of it)."""
    trainer = GRPOTrainer(_model(vocab), None, _job().spec.grpo)
    gen = torch.Generator().manual_seed(3)
    for p in trainer.params:
        p.grad = torch.randn(p.shape, generator=gen)
    trainer.optimizer.step()
    torch.manual_seed(11)  # an RNG state the resume must restore
    return save_checkpoint(directory, step=5, policy_version=5, trainer_state=trainer.state_dict())


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}/{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}/{i}").items()}
    return {prefix: value}


def _assert_same(a: Any, b: Any) -> None:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for key, va in fa.items():
        same = torch.equal(va, fb[key]) if isinstance(va, torch.Tensor) else va == fb[key]
        assert same, key


def _one_process_resume(directory: Path, vocab: int, monkeypatch) -> dict[str, Any]:
    monkeypatch.setattr(loop, "load_policy_model", lambda job: _model(vocab))
    with torch.random.fork_rng(devices=[]):
        trainer, resumed = loop.prepare_trainer(_job(), Gang(), torch.device("cpu"), None, str(directory), False)
        assert resumed is not None and resumed.step == 5
        return {"rng": torch.get_rng_state(), **_trainer_state(trainer)}


@pytest.mark.slow
@pytest.mark.parametrize("rank1_sees_it", [True, False], ids=["shared-volume", "rank-0-sends"])
def test_gang_resume_equals_one_process_and_holds_one_copy(tmp_path: Path, monkeypatch, rank1_sees_it: bool) -> None:
    """Every rank resumes the same state a lone process does, each growing by about one checkpoint.

    Pickling the whole state through broadcast_object grew rank 1 by ~4x the checkpoint. A rank
    without the volume (an emptyDir) gets the tensors from rank 0, with the same result.
    """
    ckpt = tmp_path / "ckpt"
    size = (_save_checkpoint(ckpt, BIG_VOCAB) / STATE_FILE).stat().st_size
    dirs = [ckpt, ckpt if rank1_sees_it else tmp_path / "empty"]
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    _finish([_start(r, port, dirs[r], outs[r], "--vocab", str(BIG_VOCAB)) for r in range(2)])

    expected = _one_process_resume(ckpt, BIG_VOCAB, monkeypatch)
    for out in outs:
        got = torch.load(out, weights_only=False)
        assert got["step"] == 5
        _assert_same({k: got[k] for k in expected}, expected)
        assert got["growth"] < 2 * size, f"peak RSS grew {got['growth'] / size:.1f}x the checkpoint"


@pytest.mark.slow
def test_a_member_starting_and_loading_later_than_the_collective_timeout_joins(tmp_path: Path) -> None:
    """Rank 1 starts, loads its model and reads the checkpoint each for longer than the collective
    timeout (an image pull, a download, a cold disk): the gang waits on the long-timeout store and
    control group, never in a main-group collective. Any one of the three failed the gang before."""
    _save_checkpoint(tmp_path, SMALL_VOCAB)
    port = free_port()
    first = _start(0, port, tmp_path, tmp_path / "rank0.pt", timeout_s="2")
    assert first.stdout.readline().strip() == "joining"
    time.sleep(3)  # and rank 1 still has to import torch
    late = _start(1, port, tmp_path, tmp_path / "rank1.pt", "--load-delay", "3", "--read-delay", "3", timeout_s="2")
    _finish([first, late])
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert states[0]["step"] == states[1]["step"] == 5
    _assert_same(states[0]["model"], states[1]["model"])


@pytest.mark.slow
def test_a_finished_member_leaves_the_gang_only_with_its_peers(tmp_path: Path) -> None:
    """Rank 1 is still busy after the last collective: rank 0's close waits for it, so it does not
    exit (ending the rendezvous store and its gloo connections) under a peer that still uses them."""
    _save_checkpoint(tmp_path, SMALL_VOCAB)
    port = free_port()
    marker = tmp_path / "rank1-closing"
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    _finish([_start(r, port, tmp_path, outs[r], "--closing-marker", str(marker)) for r in range(2)])
    assert outs[0].with_suffix(".closed").read_text() == "True"


if __name__ == "__main__":
    _main()
