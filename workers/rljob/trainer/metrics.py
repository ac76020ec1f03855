"""Per-step metrics: computed from the step's trajectory groups, written to Redis and a JSONL file.

The job's metrics hash (`keys.metrics`) holds the latest `TrainerMetrics` for the operator's status;
`results_dir/metrics.jsonl` one line per step for plots and benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rljob.keys import JobKeys
from rljob.protocol import TrainerMetrics, TrajectoryGroup


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Mean reward, EM, F1, format rate and searches per question over every trajectory."""
    trajs = [t for g in groups for t in g.trajectories]
    return {
        "mean_reward": _mean([t.reward for t in trajs]),
        "exact_match": _mean([t.exact_match for t in trajs]),
        "f1": _mean([t.f1 for t in trajs]),
        "format_rate": _mean([1.0 if t.format_ok else 0.0 for t in trajs]),
        "searches_per_question": _mean([float(len(t.searches)) for t in trajs]),
    }


def eval_summary(groups: Sequence[TrajectoryGroup]) -> dict[str, Any]:
    """A greedy evaluation (one sample per question): `rollout_metrics`, the number of questions, and
    one row per question, what paired tests compare."""
    return {
        **rollout_metrics(groups),
        "questions": len(groups),
        "per_question": [
            {"id": g.question_id, "em": g.trajectories[0].exact_match, "f1": g.trajectories[0].f1}
            for g in groups
            if g.trajectories
        ],
    }


class MetricsWriter:
    """Writes each step's metrics to the hash and (optionally) metrics.jsonl."""

    def __init__(self, client: Any, keys: JobKeys, results_dir: str | Path | None = None) -> None:
        self.client = client
        self.keys = keys
        self.jsonl: Path | None = None
        if results_dir is not None:
            Path(results_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = Path(results_dir) / "metrics.jsonl"

    def write(self, metrics: TrainerMetrics, extra: dict[str, Any] | None = None, *, log: bool = True) -> None:
        """Update the hash; with `log`, also append to the JSONL file."""
        self.client.hset(self.keys.metrics, mapping=metrics.to_redis())
        if log and self.jsonl is not None:
            line = json.dumps({**metrics.model_dump(), **(extra or {})}, sort_keys=True)
            with open(self.jsonl, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    def write_eval(self, name: str, result: dict[str, Any]) -> None:
        """Keep a held-out evaluation as `NAME.json` beside metrics.jsonl (local runs)."""
        if self.jsonl is not None:
            (self.jsonl.parent / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True))

    def finish(self, metrics: TrainerMetrics, *, succeeded: bool, message: str = "") -> None:
        """The final state, which the operator reads into the RLJob's status."""
        metrics.state = "succeeded" if succeeded else "failed"
        metrics.message = message[:2000]
        self.client.hset(self.keys.metrics, mapping=metrics.to_redis())
