"""The gang and checkpoints: two gloo ranks equal one process; a resumed run equals a straight one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rljob.ports import free_port
from support.toy import run_toy_training

SPEC = '{"micro_batch_size": 3, "questions_per_step": 3}'


def _toy_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "support.toy", "--threads", "1", "--spec", SPEC, *args]


def _single_thread(fn, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return fn(**kwargs)
    finally:
        torch.set_num_threads(threads)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX"}}
    env.update(extra)
    return env


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    port = str(free_port())
    procs = []
    for rank in range(2):
        # rank 1 comes from JOB_COMPLETION_INDEX, as in an Indexed Job
        position = {"RANK": "0"} if rank == 0 else {"JOB_COMPLETION_INDEX": "1"}
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", **position)
        cmd = _toy_cmd("--steps", "3", "--record-grads", "--out", str(tmp_path / "gang.pt"))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    gang = torch.load(tmp_path / "gang.pt", weights_only=False)
    single = _single_thread(
        run_toy_training, steps=3, spec_overrides={"micro_batch_size": 3, "questions_per_step": 3}, record_grads=True
    )
    assert gang["rewards"] == single["rewards"]  # same samples, so the same data reached both
    assert len(gang["grads"]) == len(single["grads"]) == 3
    for g2, g1 in zip(gang["grads"], single["grads"], strict=True):
        assert g1.abs().max() > 1e-4
        assert torch.allclose(g2, g1, atol=1e-6, rtol=1e-4)
    assert torch.allclose(gang["params"], single["params"], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_resume_from_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    straight = _single_thread(run_toy_training, steps=4)
    ckpt = tmp_path / "ckpt"
    half = _single_thread(run_toy_training, steps=2, checkpoint_dir=str(ckpt), checkpoint_every=2)
    assert half["version"] == 2 and (ckpt / "step-00000002").is_dir()
    # the second half in a fresh process, from the checkpoint alone
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "support.toy",
            "--threads",
            "1",
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ckpt),
            "--out",
            str(tmp_path / "resumed.pt"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert resumed["version"] == 4
    assert half["rewards"] + resumed["rewards"] == straight["rewards"]
    assert torch.equal(resumed["params"], straight["params"])
    assert not torch.equal(straight["params"], half["params"])


@pytest.mark.slow
def test_a_dead_member_fails_the_survivor_loudly(tmp_path: Path) -> None:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank), RLJOB_COLLECTIVE_TIMEOUT="30"
        )
        cmd = _toy_cmd("--steps", "10000")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    survivor, victim = procs
    try:
        for line in victim.stderr:  # let the gang run a couple of steps together first
            if "step 2/" in line:
                break
        victim.kill()
        victim.wait(timeout=30)
        started = time.monotonic()
        _, err = survivor.communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode != 0  # an exception, not a hang and not a silent success
    assert time.monotonic() - started < 90
    assert "Error" in err, err[-2000:]
