"""GRPOTrainer.train_step on a tiny random Llama: what contributes, what does not."""

from __future__ import annotations

import pytest
import torch

from rljob.config import AgentSpec, GRPOSpec
from rljob.protocol import TrajectoryGroup
from rljob.trainer.grpo import GRPOTrainer
from support.tiny_models import tiny_causal_lm
from support.toy import sample_toy_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _spec(**kw) -> GRPOSpec:
    base = {"group_size": 4, "questions_per_step": 2, "learning_rate": 1e-2, "micro_batch_size": 8}
    return GRPOSpec(**{**base, **kw})


def _groups(seed: int, questions: int = 2, version: int = 0) -> list[TrajectoryGroup]:
    gen = torch.Generator().manual_seed(seed)
    model = tiny_causal_lm(32, seed=1)
    groups = sample_toy_groups(
        model, step=0, questions=questions, group_size=4, policy_version=version, generator=gen, target_tokens=(5,)
    )
    for g in groups:  # make every group informative whatever was sampled
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2) + 0.1 * i
    return groups


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _degenerate(groups: list[TrajectoryGroup], value: float = 1.0) -> list[TrajectoryGroup]:
    out = [g.model_copy(deep=True) for g in groups]
    for g in out:
        for t in g.trajectories:
            t.reward = value
    return out


def test_all_equal_reward_groups_leave_the_weights_untouched() -> None:
    model = tiny_causal_lm(32)
    before = _flat(model).clone()
    trainer = GRPOTrainer(model, None, _spec(kl_coef=0.1, entropy_coef=0.01))
    stats = trainer.train_step(_degenerate(_groups(0)), current_version=0)
    assert not stats.updated and stats.degenerate_groups == 2 and stats.sequences == 0
    assert torch.equal(_flat(model), before)


def test_degenerate_group_contributes_nothing_beside_an_informative_one() -> None:
    informative = _groups(0, questions=1)
    noise = _degenerate(_groups(7, questions=1), value=0.3)
    a, b = tiny_causal_lm(32), tiny_causal_lm(32)
    GRPOTrainer(a, None, _spec()).train_step(informative, 0)
    stats = GRPOTrainer(b, None, _spec()).train_step(noise + informative, 0)
    assert stats.degenerate_groups == 1 and stats.sequences == 4
    assert torch.equal(_flat(a), _flat(b))
    assert not torch.equal(_flat(a), _flat(tiny_causal_lm(32)))


def capture_grads(trainer: GRPOTrainer) -> list[torch.Tensor]:
    """The synced, clipped gradient each optimiser step sees (Adam's first step is sign-like, so
    comparing gradients is the sharp test; comparing weights would amplify float noise)."""
    captured: list[torch.Tensor] = []
    original = trainer.optimizer.step

    def step(*args, **kwargs):
        captured.append(torch.cat([p.grad.reshape(-1).clone() for p in trainer.params]))
        return original(*args, **kwargs)

    trainer.optimizer.step = step
    return captured


def test_micro_batching_does_not_change_the_update() -> None:
    groups = _groups(3, questions=3)
    grads = []
    for mbs in (1, 5, 12):
        trainer = GRPOTrainer(tiny_causal_lm(32), None, _spec(micro_batch_size=mbs, questions_per_step=3))
        captured = capture_grads(trainer)
        trainer.train_step(groups, 0)
        grads.append(captured[0])
    assert grads[0].abs().max() > 1e-3
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)
    assert torch.allclose(grads[0], grads[2], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_kl_entropy_and_aggregations_run_and_report(aggregation: str) -> None:
    model = tiny_causal_lm(32)
    ref = tiny_causal_lm(32, seed=5)
    trainer = GRPOTrainer(model, ref, _spec(kl_coef=0.05, entropy_coef=0.01, loss_aggregation=aggregation, epochs=2))
    stats = trainer.train_step(_groups(1), 0)
    assert stats.updated and stats.sequences == 8
    assert stats.kl > 0 and stats.entropy > 0
    assert 0 <= stats.clip_fraction <= 1 and stats.grad_norm > 0


def test_stale_samples_are_dropped_and_counted() -> None:
    fresh = _groups(0, questions=1, version=5)
    stale = _groups(1, questions=1, version=2)
    trainer = GRPOTrainer(tiny_causal_lm(32), None, _spec(max_policy_lag=2))
    stats = trainer.train_step(stale + fresh, current_version=5)
    assert stats.dropped_stale == 4 and stats.sequences == 4
    # a version exactly L behind is still fresh
    stats = trainer.train_step(_groups(2, questions=1, version=3), current_version=5)
    assert stats.dropped_stale == 0 and stats.sequences == 4


def test_importance_weight_is_truncated_for_off_policy_samples() -> None:
    groups = _groups(0, questions=1)
    for g in groups:
        for t in g.trajectories:  # pretend the behaviour policy found these tokens far less likely
            old = zip(t.behaviour_logprobs, t.loss_mask, strict=True)
            t.behaviour_logprobs = [lp - 5.0 if m else lp for lp, m in old]
    trainer = GRPOTrainer(tiny_causal_lm(32, seed=1), None, _spec(importance_ratio_cap=2.0))
    stats = trainer.train_step(groups, 0)
    assert stats.truncated_fraction == pytest.approx(1.0)
    assert stats.importance_weight == pytest.approx(2.0)


def test_gradient_checkpointing_gives_the_same_gradient() -> None:
    groups = _groups(4, questions=2)
    grads = []
    for checkpointing in (False, True):
        trainer = GRPOTrainer(tiny_causal_lm(32), None, _spec(gradient_checkpointing=checkpointing))
        assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules()) == checkpointing
        captured = capture_grads(trainer)
        trainer.train_step(groups, 0)
        grads.append(captured[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)


def test_greedy_rollouts_are_refused_by_the_api_and_the_trainer() -> None:
    """T=0 makes every group identical: no advantage, no update, a job that "succeeds" unchanged."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="greater than 0"):
        AgentSpec(temperature=0.0)
    assert AgentSpec(temperature=0.05).temperature == 0.05
    with pytest.raises(ValueError, match="temperature"):
        GRPOTrainer(tiny_causal_lm(32), None, _spec(), temperature=0.0)


def _llama_with_attention_dropout() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.3,
    )
    return LlamaForCausalLM(config)


def _gpt2_with_dropout() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("make", [_llama_with_attention_dropout, _gpt2_with_dropout])
def test_the_trainer_scores_the_policy_without_dropout(make) -> None:
    """The engine samples without dropout: the trainer, which stays in train mode (activation
    checkpointing needs it), must score the same function, or a lag-0 ratio is noise."""
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, 32, (2, 12))
    expected = model.eval()(input_ids=ids).logits
    trainer = GRPOTrainer(model, None, _spec())
    assert trainer.model.training
    for _ in range(2):
        assert torch.equal(trainer.model(input_ids=ids).logits, expected)
