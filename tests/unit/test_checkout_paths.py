"""Tests run this checkout's code, in pytest and in the processes tests start, even when the
machine's shared venv has its editable install pointing at another checkout (the one that ran
set-up last)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import rljob
import rljob_operator

REPO = Path(__file__).resolve().parents[2]


def test_pytest_imports_this_checkouts_packages() -> None:
    assert Path(rljob.__file__).resolve().is_relative_to(REPO / "workers")
    assert Path(rljob_operator.__file__).resolve().is_relative_to(REPO / "operator")


def test_processes_started_by_tests_import_this_checkouts_packages(tmp_path: Path) -> None:
    code = "import rljob, rljob_operator; print(rljob.__file__); print(rljob_operator.__file__)"
    # From another folder, so the current directory cannot be what finds them.
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=os.environ, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    workers_file, operator_file = (Path(line).resolve() for line in out.stdout.split())
    assert workers_file.is_relative_to(REPO / "workers") and operator_file.is_relative_to(REPO / "operator")


def test_setup_puts_this_checkout_before_another_on_the_path(tmp_path: Path) -> None:
    """setup.sh's PYTHONPATH line, run with another checkout's packages already on the path."""
    (decoy := tmp_path / "other" / "workers" / "rljob").mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the other checkout')\n")
    lines = [line for line in (REPO / "scripts" / "setup.sh").read_text().splitlines() if "export PYTHONPATH" in line]
    assert len(lines) == 1
    script = f"""repo={REPO}; {lines[0]}; exec {sys.executable} -c 'import rljob; print(rljob.__file__)'"""
    env = {**os.environ, "PYTHONPATH": str(decoy.parent)}
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().is_relative_to(REPO / "workers")
