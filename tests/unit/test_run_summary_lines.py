"""The closing lines of `rljob run` say what the warm-up did, what RL changed on the same
questions, and how the training reward moved."""

from __future__ import annotations

from rljob.cli import closing_lines
from rljob.config import RLJob


def _eval(em: list[float]) -> dict:
    rows = [{"id": f"q{i}", "em": e, "f1": e} for i, e in enumerate(em)]
    n = len(rows)
    return {
        "exact_match": sum(em) / n,
        "f1": sum(em) / n,
        "format_rate": 1.0,
        "searches_per_question": 1.0,
        "questions": n,
        "per_question": rows,
    }


def test_lines_separate_the_warmup_from_rl_and_show_the_reward_trend() -> None:
    summary = {
        "results_dir": "r",
        "warmup": {"examples": 16, "steps": 4, "first_loss": 1.8, "last_loss": 0.4},
        "eval_before": _eval([0.0] * 50),
        "eval_after": _eval([1.0] * 5 + [0.0] * 45),
        "steps_trained": 8,
        "rewards": [0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.5, 0.7],
    }
    lines = closing_lines(summary, RLJob())
    assert lines[0].startswith("warm-up (supervised, before RL): 16 demonstrations, 4 steps, loss 1.80 -> 0.40")
    assert lines[1].startswith("before RL: EM 0.000") and "(n=50, evaluation set)" in lines[1]
    assert lines[2].startswith("after 8 RL steps: EM 0.100")
    assert "EM 0.000 -> 0.100 (+0.100; 5 gained, 0 lost, McNemar p=0.0625)" in lines[3]
    assert lines[4] == "training reward, mean of the first 2 RL steps 0.150 -> last 2 0.600"
    assert lines[-1] == "done: metrics, evals and plots in r"
    pooled = RLJob.model_validate({"spec": {"grpo": {"questionsPerStep": 6, "maxQuestions": 12}}})
    same = " (each quarter asks the same 12 questions, grpo.maxQuestions)"
    assert closing_lines(summary, pooled)[4] == lines[4] + same
    uneven = RLJob.model_validate({"spec": {"grpo": {"questionsPerStep": 5, "maxQuestions": 12}}})
    assert closing_lines(summary, uneven)[4] == lines[4]


def test_a_run_without_warmup_or_evaluations_says_only_where_its_results_are() -> None:
    assert closing_lines({"results_dir": "r", "rewards": [0.1]}, RLJob()) == ["done: metrics, evals and plots in r"]
