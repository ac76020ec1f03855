"""The weight benchmarks still run end to end (their numbers live in docs/results and are made by
hand; this only keeps the scripts from rotting as the store's API moves). --quick takes ~12 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # the JSON summary is the last line


def test_weight_delta_quick(tmp_path):
    summary = run_benchmark("bench_weight_delta.py", "--quick", "--out", str(tmp_path / "wd"))
    assert summary["device"] == "cpu"
    targets = summary["targets"]
    assert targets["lossless_every_version"]
    # A reader that decoded wrongly ends right all the same, through a full: that must not pass.
    assert targets["no_reader_recovered_or_fell_back"]
    assert targets["bytes_per_change_target_2.5_met"]
    assert (tmp_path / "wd.png").stat().st_size > 0 and (tmp_path / "wd.json").exists()


def test_weight_delta_quick_on_random_weights_of_the_same_shapes(tmp_path):
    """`--weights random` is what scripts/device_checks.sh runs on a GPU machine (no model file there)."""
    summary = run_benchmark("bench_weight_delta.py", "--quick", "--weights", "random", "--out", str(tmp_path / "wd"))
    assert "random init" in summary["model"] and summary["numel"] == 134_515_008
    assert summary["targets"]["lossless_every_version"] and summary["targets"]["no_reader_recovered_or_fell_back"]


def test_weight_pass_runs(tmp_path):
    summary = run_benchmark("bench_weight_pass.py", "--reps", "1", "--results", str(tmp_path))
    assert (tmp_path / "weight_pass.json").exists()
    assert summary["rows"] and all(row["find_s"] > 0 for row in summary["rows"])
    assert set(summary["read_alone_s"]) == {"1", "2"} and all(s > 0 for s in summary["read_alone_s"].values())


@pytest.mark.parametrize("same_script", [False, True])
def test_compare_revisions_runs_a_base_and_this_checkout_in_turns(tmp_path, same_script):
    """Against HEAD itself (the base tree is a fresh worktree of it), each side with its own
    benchmark script or both with this checkout's: every row and metric has both sides, and the
    temporary worktree is gone afterwards."""
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    flags = ["--same-script"] if same_script else []
    summary = run_benchmark(
        "compare_revisions.py",
        "--base",
        "HEAD",
        "--pairs",
        "1",
        "--out",
        str(tmp_path / "ab"),
        *flags,
        "--",
        "--quick",
        "--weights",
        "random",
    )
    assert summary["pairs"] == 1 and summary["bench_args"] == ["--quick", "--weights", "random"]
    assert summary["same_script"] is same_script
    table = json.loads((tmp_path / "ab.json").read_text())["table"]
    assert {entry["row"] for entry in table} >= {"synthetic 1%", "synthetic 10%"}
    assert all(entry["base"] > 0 and entry["head"] > 0 and entry["gain"] > 0 for entry in table)
    assert (tmp_path / "ab.png").stat().st_size > 0
    assert subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout == worktrees
