"""Learning sanity: the real GRPO step raises a toy reward with a tiny model within seconds."""

from __future__ import annotations

import torch

from rljob.config import GRPOSpec
from rljob.trainer.grpo import GRPOTrainer
from support.tiny_models import tiny_causal_lm
from support.toy import mean_reward, sample_toy_groups


def test_mean_reward_rises_on_a_toy_reward() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tiny_causal_lm(64)
            spec = GRPOSpec(group_size=8, questions_per_step=4, learning_rate=1e-2, micro_batch_size=32)
            trainer = GRPOTrainer(model, None, spec)
            rewards = []
            for step in range(30):
                groups = sample_toy_groups(model, step=step, questions=4, group_size=8, policy_version=step)
                rewards.append(mean_reward(groups))
                trainer.train_step(groups, step)
    finally:
        torch.set_num_threads(threads)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # untrained: ~1/64 of the tokens are the target; trained: a large share
    assert first < 0.05
    assert last > 0.25 and last > 5 * first, rewards
