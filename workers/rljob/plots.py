"""PNG plots of a run's metrics.jsonl: reward, informative groups, eval EM/F1, step time split, weight bytes."""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(results_dir: Path) -> list[dict]:
    path = Path(results_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_points(results_dir: Path, rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, EM, F1) of every evaluation: those the metrics rows carry, and the one before
    training (eval_before.json: it is written before the first step, so no row carries it)."""
    points = {
        r["step"]: (r["eval_exact_match"], r["eval_f1"])
        for r in rows
        if r.get("eval_exact_match") is not None and r.get("eval_step") == r["step"]
    }
    before = Path(results_dir) / "eval_before.json"
    if before.exists():
        first = json.loads(before.read_text())
        points.setdefault(int(first.get("step", 0)), (first["exact_match"], first["f1"]))
    return [(step, em, f1) for step, (em, f1) in sorted(points.items())]


def plot_run(results_dir: Path) -> list[Path]:
    """Write one PNG per panel next to metrics.jsonl; returns the paths written."""
    rows = load_metrics(results_dir)
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    written: list[Path] = []

    def save(fig, ax, title: str, name: str) -> None:
        ax.set_xlabel("step")
        ax.set_title(title)
        path = Path(results_dir) / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.get("mean_reward", 0.0) for r in rows], label="mean reward")
    ax.plot(steps, [r.get("exact_match", 0.0) for r in rows], label="train EM")
    ax.legend()
    save(fig, ax, "reward", "reward.png")

    if any("informative_group_rate" in r for r in rows):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [r.get("informative_group_rate", 0.0) for r in rows], "o-", label="informative / generated")
        ax.plot(steps, [r.get("groups_generated", 0) for r in rows], "s--", label="groups generated")
        ax.legend()
        save(fig, ax, "groups with signal (rewards not all equal)", "informative_groups.png")

    evals = eval_points(results_dir, rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if evals:
        ax.plot([step for step, _, _ in evals], [em for _, em, _ in evals], "o-", label="eval EM")
        ax.plot([step for step, _, _ in evals], [f1 for _, _, f1 in evals], "s-", label="eval F1")
        ax.legend()
    save(fig, ax, "held-out evaluation", "eval.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    wait = [r.get("wait_seconds", 0.0) for r in rows]
    train = [r.get("train_seconds", 0.0) for r in rows]
    ax.bar(steps, wait, label="waiting for rollouts")
    ax.bar(steps, train, bottom=wait, label="training + publish")
    ax.set_ylabel("seconds")
    ax.legend()
    save(fig, ax, "step time", "step_time.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(steps, [max(1, r.get("weight_bytes", 0)) for r in rows], "o-")
    ax.set_ylabel("bytes published")
    save(fig, ax, "weight bytes per step", "weight_bytes.png")
    return written
