"""The run's plots: the evaluation panel shows the evaluation before training too."""

from __future__ import annotations

import json
from pathlib import Path

from rljob.plots import eval_points, plot_run


def test_the_eval_plot_has_the_evaluation_before_training(tmp_path: Path) -> None:
    # The step-0 evaluation is written to eval_before.json before any metrics row exists, so the
    # panel showed only the evaluation after training: one dot, not the before/after README promises.
    rows = [
        {"step": 1, "mean_reward": 0.1},
        {"step": 2, "mean_reward": 0.2, "eval_exact_match": 0.5, "eval_f1": 0.6, "eval_step": 2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval_before.json").write_text(json.dumps({"step": 0, "exact_match": 0.0, "f1": 0.25}))
    assert eval_points(tmp_path, rows) == [(0, 0.0, 0.25), (2, 0.5, 0.6)]
    written = plot_run(tmp_path)
    assert {p.name for p in written} == {"reward.png", "eval.png", "step_time.png", "weight_bytes.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_without_an_evaluation_before_only_the_rows_count(tmp_path: Path) -> None:
    rows = [{"step": 3, "eval_exact_match": 1.0, "eval_f1": 1.0, "eval_step": 3}, {"step": 4}]
    assert eval_points(tmp_path, rows) == [(3, 1.0, 1.0)]


def test_runs_that_count_informative_groups_get_their_panel(tmp_path: Path) -> None:
    rows = [{"step": s, "mean_reward": 0.1 * s, "informative_group_rate": 0.5, "groups_generated": 8} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot_run(tmp_path)}
    assert "informative_groups.png" in names and "reward.png" in names
