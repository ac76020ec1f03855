"""The HotpotQA sample ships inside the package: no folder beside the checkout, no environment variable."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from rljob.assets import SAMPLE_DIR, hotpotqa_file
from rljob.config import RLJob
from rljob.data.hotpotqa import load_questions, load_records
from rljob.runtime_env import resolve_bundled

REPO = Path(__file__).resolve().parents[2]


def _first_id(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.loads(fh.readline())["_id"]


def test_sample_is_package_data_of_the_documented_size(monkeypatch) -> None:
    monkeypatch.delenv("RLJOB_DATA_DIR", raising=False)
    train, dev = hotpotqa_file("train.jsonl"), hotpotqa_file("dev.jsonl")
    assert train.parent == dev.parent == SAMPLE_DIR and train.name == "train.jsonl.gz"
    assert len(load_questions(train)) == 2005 and len(load_questions(dev)) == 300
    assert "CC BY-SA 4.0" in (SAMPLE_DIR / "README.md").read_text()
    # The raw records (the warm-up's reader) read the same gzip file the same way.
    assert [r["_id"] for r in load_records(dev, limit=5)] == [q.id for q in load_questions(dev, limit=5)]


def test_bundled_paths_resolve_to_the_package_sample(monkeypatch) -> None:
    monkeypatch.delenv("RLJOB_DATA_DIR", raising=False)
    job = RLJob.model_validate(
        {
            "spec": {
                "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                "data": {"trainPath": "bundled:train.jsonl", "evalPath": "bundled:dev.jsonl"},
            }
        }
    )
    data = resolve_bundled(job).spec.data
    assert Path(data.eval_path) == SAMPLE_DIR / "dev.jsonl.gz"
    assert load_questions(data.eval_path)[0].id == _first_id(SAMPLE_DIR / "dev.jsonl.gz")


def test_data_dir_override_reads_plain_and_gzip_files(tmp_path, monkeypatch) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with gzip.open(SAMPLE_DIR / "dev.jsonl.gz", "rt", encoding="utf-8") as fh:
        lines = fh.readlines()[:7]
    (plain / "dev.jsonl").write_text("".join(lines))
    monkeypatch.setenv("RLJOB_DATA_DIR", str(plain))
    assert hotpotqa_file("dev.jsonl") == plain / "dev.jsonl"
    assert len(load_questions(hotpotqa_file("dev.jsonl"))) == 7
    # gzip is told by content: a .jsonl holding gzip bytes reads too
    (plain / "dev.jsonl").write_bytes(gzip.compress("".join(lines[:3]).encode()))
    assert len(load_questions(plain / "dev.jsonl")) == 3


def test_data_dir_override_missing_file_names_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RLJOB_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="unset RLJOB_DATA_DIR"):
        hotpotqa_file("train.jsonl")


@pytest.mark.slow
def test_wheel_carries_the_sample(tmp_path) -> None:
    """Build a wheel from a copy of the project, install it into a throwaway venv, and resolve
    `bundled:dev.jsonl` there, away from any checkout and with no RLJOB_DATA_DIR."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("workers", "operator"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLJOB_DATA_DIR")}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("rljob-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True, env=env
        ).strip()
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        env=env,
    )
    # rljob's own dependencies (pydantic, PyYAML) from this venv, after the wheel on the path. A
    # path in a .pth file does not run that folder's own .pth files, so this venv's editable rljob
    # stays out of sight.
    (site / "zz_test_deps.pth").write_text(f"{Path(pydantic.__file__).parents[1]}\n")
    probe = (
        "import json, rljob\n"
        "from rljob.config import RLJob\n"
        "from rljob.runtime_env import resolve_bundled\n"
        "from rljob.data.hotpotqa import load_questions\n"
        "job = RLJob.model_validate({'spec': {'model': {'name': 'HuggingFaceTB/SmolLM2-135M-Instruct'},"
        " 'data': {'trainPath': 'bundled:train.jsonl', 'evalPath': 'bundled:dev.jsonl'}}})\n"
        "path = resolve_bundled(job).spec.data.eval_path\n"
        "qs = load_questions(path)\n"
        "print(json.dumps({'package': rljob.__file__, 'path': path, 'n': len(qs), 'first': qs[0].id}))\n"
    )
    out = json.loads(subprocess.check_output([python, "-c", probe], text=True, env=env, cwd=tmp_path).splitlines()[-1])
    assert out["package"].startswith(str(site)) and out["path"].startswith(str(site))
    assert out["n"] == 300 and out["first"] == _first_id(SAMPLE_DIR / "dev.jsonl.gz")
