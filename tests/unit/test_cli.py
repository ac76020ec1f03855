"""Every `rljob` subcommand turns bad input into one line on stderr and exit 2, before anything heavy.

The heavy entry points (the local run, the evaluation, the worker loops) are replaced by stubs that
fail the test if reached, so each case also proves the error comes before any model or data loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import rljob.evaluate
import rljob.local_run
from rljob.cli import main


def _must_not_run(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("bad input reached the heavy part")


@pytest.fixture(autouse=True)
def no_heavy_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rljob.local_run, "LocalRun", _must_not_run)
    monkeypatch.setattr(rljob.evaluate, "evaluate_cli", _must_not_run)


def _manifest(tmp_path: Path, **spec: Any) -> Path:
    """A valid manifest (hub model name, so nothing is fetched) with `spec` merged in."""
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("")
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "cli-test"},
        "spec": {
            "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
            "data": {"trainPath": str(tmp_path / "train.jsonl"), "evalPath": str(tmp_path / "dev.jsonl")},
            **spec,
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _bad_manifests(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Unusable manifests, each with a piece of the message it must give."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("kind: RLJob\nspec: [unclosed\n")
    no_rljob = tmp_path / "other.yaml"
    no_rljob.write_text("kind: ConfigMap\n")
    (tmp_path / "schema").mkdir()
    schema = _manifest(tmp_path / "schema", grpo={"groupSize": 1})
    (tmp_path / "data").mkdir()
    data = _manifest(tmp_path / "data")
    (tmp_path / "data" / "train.jsonl").unlink()
    return {
        "missing file": (tmp_path / "nope.yaml", "No such file or directory"),
        "directory": (tmp_path, "Is a directory"),
        "YAML syntax": (bad_yaml, "not valid YAML"),
        "no RLJob document": (no_rljob, "no document with kind: RLJob"),
        "schema": (schema, "groupSize"),
        "missing data file": (data, "does not exist"),
    }


CASES = ["missing file", "directory", "YAML syntax", "no RLJob document", "schema", "missing data file"]


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["run", "eval"])
def test_bad_manifest_is_a_clean_error(
    command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, needle = _bad_manifests(tmp_path)[case]
    argv = [command, str(path), *(["--local"] if command == "run" else [])]
    code, err = _run_main(argv, capsys)
    assert code == 2
    assert err.startswith(f"rljob {command}: ") and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["rollout", "train"])
def test_pod_entry_points_refuse_a_bad_manifest(
    command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, needle = _bad_manifests(tmp_path)[case]
    monkeypatch.setenv("RLJOB_CONFIG", str(path))
    monkeypatch.setenv("RLJOB_REDIS_URL", "redis://127.0.0.1:1/0")
    code, err = _run_main([command], capsys)
    assert code == 2 and err.startswith(f"rljob {command}: ") and needle in err, err


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_pod_entry_points_name_missing_environment(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLJOB_CONFIG", raising=False)
    monkeypatch.delenv("RLJOB_REDIS_URL", raising=False)
    code, err = _run_main([command], capsys)
    assert code == 2 and "RLJOB_CONFIG" in err and "RLJOB_REDIS_URL" in err, err


def test_run_needs_local_and_a_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _manifest(tmp_path)
    code, err = _run_main(["run", str(path)], capsys)
    assert code == 2 and "needs --local" in err
    code, err = _run_main(["run", str(path), "--local", "--workers", "0"], capsys)
    assert code == 2 and "--workers" in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--questions", "missing.jsonl"], "--questions"),
        (["--questions", "empty.jsonl"], "holds no questions"),  # fell back to the job's eval set
        (["--questions", "broken.jsonl"], "not HotpotQA"),
        (["--checkpoint", "missing-dir"], "--checkpoint"),
        (["--checkpoint", "."], "not a trainer checkpoint"),  # a folder without step-N checkpoints
        (["--limit", "0"], "--limit"),
        (["--output", "no/such/folder/out.json"], "--output"),
        (["--output", "."], "a folder"),  # passed the checks, then failed after the whole evaluation
    ],
)
def test_eval_checks_its_paths_before_loading_the_model(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _manifest(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl").write_text('{"question": "no answer or context"\n')
    code, err = _run_main(["eval", str(path), *extra], capsys)
    assert code == 2 and err.startswith("rljob eval: ") and needle in err, err


QUESTION = {"_id": "q1", "question": "Who?", "answer": "Ann", "context": [["A", ["Ann did."]]]}


def test_eval_with_good_input_reaches_the_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _manifest(tmp_path)
    step = tmp_path / "ckpt" / "step-00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (tmp_path / "q.jsonl").write_text(json.dumps(QUESTION) + "\n")
    seen: list[Any] = []
    monkeypatch.setattr(rljob.evaluate, "evaluate_cli", lambda args, job: seen.append(args) or 0)
    argv = [
        "eval",
        str(path),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--questions",
        str(tmp_path / "q.jsonl"),
        "--limit",
        "3",
        "--output",
        str(tmp_path / "out.json"),
    ]
    code, err = _run_main(argv, capsys)
    assert code == 0 and len(seen) == 1 and seen[0].limit == 3, err


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    """The same path through a real process, as a user or a pod sees it."""
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli", "eval", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("rljob eval: ") and "Traceback" not in result.stderr


def test_rljob_eval_scores_by_default_what_the_trainer_evaluates() -> None:
    # The trainer scores the first eval.questions of the eval set; `rljob eval FILE` scored the
    # whole set (300 questions against the local example's 16), so the two did not compare.
    from rljob.config import RLJob
    from rljob.evaluate import questions_to_score

    job = RLJob.model_validate({"spec": {"eval": {"questions": 16}}})
    pool = list(range(300))
    assert questions_to_score(pool, job, from_file=False, limit=None) == list(range(16))
    assert questions_to_score(pool, job, from_file=False, limit=5) == list(range(5))
    assert questions_to_score(pool, job, from_file=True, limit=None) == pool  # a --questions file: whole
    assert questions_to_score(pool, job, from_file=True, limit=40) == list(range(40))


def test_rljob_eval_scores_the_weights_the_workers_serve() -> None:
    """Workers run the bf16 values the weight store publishes; `rljob eval` scored the fp32 base
    model or fp32 checkpoint masters, whose greedy trajectories can differ."""
    import torch

    from rljob.evaluate import round_to_served
    from rljob.weights.checksum import bf16_bits
    from support.tiny_models import tiny_causal_lm

    model = tiny_causal_lm(32)
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in masters.values())
    storage = [p.data_ptr() for p in model.parameters()]
    round_to_served(model)
    assert [p.data_ptr() for p in model.parameters()] == storage  # in place
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert (bf16_bits(p) == bf16_bits(masters[name])).all()  # the publisher's rounding of the masters
        assert torch.equal(p, p.to(torch.bfloat16).float())  # exactly bf16 values


def _started_run(folder: Path, manifest: Path) -> None:
    """What `rljob run --local` leaves in its results folder once started."""
    from rljob.cli import load_job

    folder.mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(load_job(str(manifest)).model_dump(by_alias=True, mode="json")))


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        # Reusing a folder resumed its checkpoints and Redis data silently, reporting the old run.
        ("earlier run, no --resume", "holds an earlier run; add --resume"),
        ("--resume, nothing there", "holds no earlier run to resume"),
        ("--resume, manifest changed", "the manifest differs"),
        ("results folder not writable", "cannot write there"),
        ("no redis-server", "redis-server was not found on PATH"),
    ],
)
def test_run_checks_its_results_folder_and_redis_before_starting(
    case: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _manifest(tmp_path)
    results = tmp_path / "results"
    argv = ["run", str(path), "--local", "--results", str(results)]
    if case == "earlier run, no --resume":
        _started_run(results, path)
    elif case == "--resume, nothing there":
        argv.append("--resume")
    elif case == "--resume, manifest changed":
        _started_run(results, path)
        path = _manifest(tmp_path, grpo={"learningRate": 1e-3})
        argv.append("--resume")
    elif case == "results folder not writable":
        (tmp_path / "a-file").write_text("")
        argv[argv.index(str(results))] = str(tmp_path / "a-file" / "results")
    else:
        monkeypatch.setenv("PATH", str(tmp_path))
    code, err = _run_main(argv, capsys)
    assert code == 2 and err.startswith("rljob run: ") and needle in err, err


def test_run_resumes_an_earlier_run_of_the_same_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _manifest(tmp_path)
    results = tmp_path / "results"
    _started_run(results, path)
    seen: list[Any] = []
    monkeypatch.setattr(rljob.local_run, "LocalRun", lambda job, folder, **kw: seen.append(folder) or _Done())
    code, err = _run_main(["run", str(path), "--local", "--results", str(results), "--resume"], capsys)
    assert code == 3 and seen == [results], err


class _Done:
    def run(self) -> int:
        return 3  # not 0: no results to summarise
