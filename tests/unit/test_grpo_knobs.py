"""GRPO knobs beside the loss: learning-rate warm-up, refill prompts, informative-group counting."""

from __future__ import annotations

import pytest

from rljob.assets import hotpotqa_file
from rljob.config import GRPOSpec, RLJob
from rljob.data import load_questions
from rljob.protocol import Trajectory, TrajectoryGroup
from rljob.trainer.batch import informative_groups
from rljob.trainer.grpo import GRPOTrainer
from rljob.trainer.prompts import refill_requests, step_requests
from support.tiny_models import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_learning_rate_warms_up_linearly_and_resumes_where_it_was() -> None:
    trainer = GRPOTrainer(tiny_causal_lm(16), None, GRPOSpec(learning_rate=1e-3, lr_warmup_steps=4))
    seen = []
    for _ in range(6):
        seen.append(trainer.learning_rate)
        trainer.updates += 1
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    restored = GRPOTrainer(tiny_causal_lm(16), None, GRPOSpec(learning_rate=1e-3, lr_warmup_steps=4))
    state = GRPOTrainer(tiny_causal_lm(16), None, GRPOSpec(learning_rate=1e-3, lr_warmup_steps=4)).state_dict()
    state["updates"] = 2
    restored.load_state_dict(state)
    assert restored.learning_rate == pytest.approx(7.5e-4)
    assert GRPOTrainer(tiny_causal_lm(16), None, GRPOSpec(learning_rate=1e-3)).learning_rate == 1e-3


def test_refill_prompts_are_deterministic_unique_and_capped() -> None:
    job = RLJob.model_validate(
        {
            "metadata": {"name": "k", "namespace": "t"},
            "spec": {"grpo": {"questionsPerStep": 4, "groupSize": 2, "dynamicSampling": True, "maxRefillRounds": 2}},
        }
    )
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=50)
    ids = set()
    for step in range(5):
        regular = step_requests(step, questions, job, 0, "7")
        for round_ in range(2):
            refill = refill_requests(step, round_, 10, questions, job, 3, "7")
            assert len(refill) == 4 and all(r.step == step and r.min_policy_version == 3 for r in refill)
            assert refill == refill_requests(step, round_, 10, questions, job, 3, "7")
            ids |= {r.request_id for r in refill}
        ids |= {r.request_id for r in regular}
    assert len(ids) == 5 * 4 * 3  # no request id repeats across steps, rounds and the regular prompts


def _group(rewards: list[float], version: int = 0) -> TrajectoryGroup:
    trajs = [
        Trajectory(
            token_ids=[1, 2],
            prompt_length=1,
            loss_mask=[0, 1],
            behaviour_logprobs=[0.0, -1.0],
            policy_version=version,
            reward=r,
        )
        for r in rewards
    ]
    return TrajectoryGroup(request_id="r", step=0, question_id="q", worker_id="w", trajectories=trajs)


def test_informative_groups_are_those_with_unequal_fresh_rewards() -> None:
    groups = [_group([0.0, 1.0]), _group([0.1, 0.1]), _group([1.0, 0.0], version=0), _group([0.0, 0.5], version=5)]
    assert informative_groups(groups, current_version=5, max_policy_lag=0) == 1
    assert informative_groups(groups, current_version=5, max_policy_lag=5) == 3
