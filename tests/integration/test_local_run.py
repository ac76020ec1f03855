"""`rljob run --local` end to end on a tiny random model: real redis-server, real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import load_questions

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from support.tiny_models import save_tiny_model

    texts = [q.question for q in load_questions(hotpotqa_file("train.jsonl"), limit=200)]
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), texts, vocab_size=256)


def write_manifest(path: Path, model: Path | str, total_steps: int = 2, restart_limit: int = 3) -> Path:
    manifest = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "local-test"},
        "spec": {
            "model": {"name": str(model)},
            "data": {"trainPath": "bundled:train.jsonl", "evalPath": "bundled:dev.jsonl", "maxTrainQuestions": 20},
            "agent": {"maxTurns": 2, "maxNewTokensPerTurn": 12, "maxTotalTokens": 400, "formatReward": 0.2},
            "grpo": {
                "groupSize": 2,
                "questionsPerStep": 2,
                "microBatchSize": 4,
                "totalSteps": total_steps,
                "learningRate": 1e-3,
                "checkpointInterval": 1,
            },
            "rollout": {"batchSize": 2},
            "eval": {"interval": 2, "questions": 3},
            "restartLimit": restart_limit,
        },
    }
    path.write_text(yaml.safe_dump(manifest))
    return path


def rljob(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rljob.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def leftover_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_local_run_completes_with_results_and_no_stray_processes(tmp_path, tiny_model):
    results = tmp_path / "results"
    manifest = write_manifest(tmp_path / "job.yaml", tiny_model)
    proc = rljob("run", str(manifest), "--local", "--results", str(results))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["state"] == "running" and rows[-1]["policy_version"] >= 2
    before = json.loads((results / "eval_before.json").read_text())
    after = json.loads((results / "eval_after.json").read_text())
    assert before["questions"] == after["questions"] == 3
    assert before["step"] == 0 and after["step"] == 2
    for png in ("reward.png", "eval.png", "step_time.png", "weight_bytes.png"):
        assert (results / png).stat().st_size > 1000
    assert json.loads((results / "eval_step2.json").read_text()) == after  # every evaluation keeps its file
    assert "before RL: EM" in out and "after 2 RL steps: EM" in out and "RL's change, paired" in out
    assert leftover_processes(str(results)) == []


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(("started_with_sigint_ignored", "twice"), [(False, False), (True, False), (False, True)])
def test_ctrl_c_stops_every_child(tmp_path, tiny_model, started_with_sigint_ignored, twice):
    """Ctrl-C (SIGINT to the process group) stops the run with 130 and leaves no process behind,
    also when the run was started with SIGINT ignored, as a shell starts background jobs (`&`,
    nohup) and as some CI runners start their steps (Python keeps an ignored SIGINT ignored), and
    when a second Ctrl-C comes during the shutdown (it cut the shutdown short and left the
    embedded redis-server running in its own session)."""
    results = tmp_path / "results"
    manifest = write_manifest(tmp_path / "job.yaml", tiny_model, total_steps=1000)
    start = {"preexec_fn": _ignore_sigint} if started_with_sigint_ignored else {}
    proc = rljob("run", str(manifest), "--local", "--results", str(results), **start)
    deadline = time.monotonic() + 300
    while not (results / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (results / "metrics.jsonl").exists(), "the run never reached its first step"
    os.killpg(proc.pid, signal.SIGINT)
    if twice:
        # Ctrl-C again and again until the run is gone: during the shutdown (the rollout worker
        # is finishing its batch) and after it, while the process exits.
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert leftover_processes(str(results)) == []


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_killed_outright_leaves_no_process(tmp_path, tiny_model, process_ended):
    """kill -9 (or the OOM killer) gives the run no shutdown; its redis-server, rollout worker and
    trainer, each in a session of its own, ran on for good. Now they end with it."""
    results = tmp_path / "results"
    manifest = write_manifest(tmp_path / "job.yaml", tiny_model, total_steps=1000)
    proc = rljob("run", str(manifest), "--local", "--results", str(results))
    deadline = time.monotonic() + 300
    while not (results / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (results / "metrics.jsonl").exists(), "the run never reached its first step"
    children = _children(proc.pid)
    assert len(children) == 3, children  # redis-server, one rollout worker, one trainer
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()  # type: ignore[union-attr]  # the trainer held its write end: no communicate()
    deadline = time.monotonic() + 30
    while not all(process_ended(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_ended(pid) for pid in children), [pid for pid in children if not process_ended(pid)]
    assert leftover_processes(str(results)) == []


def _child(pid: int, role: str) -> int:
    """The run's child process that serves `role`: `rljob.cli rollout`, `rljob.cli train`, or
    redis-server (which renames itself `/usr/bin/redis-server 127.0.0.1:PORT`)."""
    out = subprocess.run(["pgrep", "-a", "-P", str(pid)], capture_output=True, text=True).stdout
    commands = dict(line.split(None, 1) for line in out.splitlines())
    (found,) = [p for p, cmd in commands.items() if role in (Path(cmd.split()[0]).name, cmd.split()[-1])]
    return int(found)


def _after_first_step(results: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (results / "metrics.jsonl").exists() and (results / "metrics.jsonl").read_text().strip():
            return
        time.sleep(0.2)
    raise AssertionError("the run never finished its first step")


@pytest.mark.parametrize(
    ("role", "said"),
    [
        ("rollout", "rollout-0 exited with code -9; starting it again"),
        ("train", "trainer-0 exited with code -9; restarting the trainers from their last checkpoint"),
        ("redis-server", "redis-server died; restarting it on its append-only file"),
    ],
)
def test_a_crashed_child_is_restarted_and_the_run_finishes(tmp_path, tiny_model, role, said):
    """As the cluster does: a worker is started again, a trainer gang restarts from its checkpoint,
    Redis comes back on its AOF; the run ends as if nothing happened, every step trained."""
    results = tmp_path / "results"
    manifest = write_manifest(tmp_path / "job.yaml", tiny_model, total_steps=6)
    proc = rljob("run", str(manifest), "--local", "--results", str(results))
    _after_first_step(results)
    os.kill(_child(proc.pid, role), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert said in out, out
    steps = [json.loads(line)["step"] for line in (results / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and set(steps) == set(range(1, 7)), steps
    if role == "train":
        assert "resumed from" in out, out
    else:
        assert steps == list(range(1, 7)), steps  # the trainer itself never restarted
    assert leftover_processes(str(results)) == []


def test_past_the_restart_limit_the_run_stops_naming_the_failure_and_the_resume(tmp_path, tiny_model):
    results = tmp_path / "results"
    manifest = write_manifest(tmp_path / "job.yaml", tiny_model, total_steps=1000, restart_limit=0)
    proc = rljob("run", str(manifest), "--local", "--results", str(results))
    _after_first_step(results)
    os.kill(_child(proc.pid, "train"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "trainer-0 exited with code -9, past restartLimit 0" in out, out
    assert f"rljob run {manifest} --local --results {results} --resume" in out, out
    assert leftover_processes(str(results)) == []


def test_missing_model_is_a_clear_error(tmp_path):
    manifest = write_manifest(tmp_path / "job.yaml", tmp_path / "no-such-model")
    proc = rljob("run", str(manifest), "--local", "--results", str(tmp_path / "results"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "no-such-model" in out
