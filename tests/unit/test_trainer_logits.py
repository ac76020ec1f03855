"""The trainer's fast paths against the plain computation: the output layer only at loss positions,
a group's prompt computed once a micro-batch, length-sorted micro-batches, and a bf16-autocast
body with an fp32 head."""

from __future__ import annotations

import pytest
import torch

from rljob.config import GRPOSpec
from rljob.trainer.batch import Sample, collate, prompt_micro_batches, shared_prefix_length, trainable_samples
from rljob.trainer.grpo import GRPOTrainer
from rljob.trainer.logits import _head_logits, masked_token_logprobs
from rljob.trainer.loss import aggregate, grpo_token_terms, token_entropy, token_logprobs
from support.tiny_models import tiny_causal_lm
from support.toy import sample_toy_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEMPERATURE = 0.8
PROMPT = 12  # tokens of each toy question's prompt, shared by its group


def _ragged_groups():
    """Toy groups whose trajectories are cut to different lengths (so micro-batches pad)."""
    gen = torch.Generator().manual_seed(4)
    groups = sample_toy_groups(
        tiny_causal_lm(32, seed=1),
        step=0,
        questions=3,
        group_size=4,
        policy_version=0,
        generator=gen,
        prompt_length=PROMPT,
        new_tokens=(6, 9),
        injected=(3, 4, 7),
    )
    for g in groups:
        for i, t in enumerate(g.trajectories):
            cut = len(t.token_ids) - 2 * i
            t.token_ids, t.loss_mask, t.behaviour_logprobs = (
                t.token_ids[:cut],
                t.loss_mask[:cut],
                t.behaviour_logprobs[:cut],
            )
            t.reward = float(i % 2) + 0.1 * i
    return groups


def _full_vocab_gradient(model, groups, spec: GRPOSpec) -> torch.Tensor:
    """The step's gradient as the trainer computed it before: full logits at every position, one
    micro-batch in arrival order."""
    samples = trainable_samples(groups, current_version=0, max_policy_lag=spec.max_policy_lag, scale_rewards=True)
    mb = collate(samples.samples, 0)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1] / TEMPERATURE
    logp = token_logprobs(logits, mb.targets)
    terms = grpo_token_terms(
        logp,
        logp.detach(),
        mb.behaviour_logp,
        mb.advantages,
        mb.mask,
        clip_epsilon=spec.clip_epsilon,
        ratio_cap=spec.importance_ratio_cap,
        entropy=token_entropy(logits),
        entropy_coef=spec.entropy_coef,
    )
    tokens = sum(s.num_loss_tokens for s in samples.samples)
    aggregate(
        terms.loss, mb.mask, spec.loss_aggregation, total_tokens=tokens, total_sequences=len(samples.samples)
    ).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_head_at_loss_positions_and_sorted_micro_batches_give_the_full_vocab_gradient() -> None:
    groups = _ragged_groups()
    spec = GRPOSpec(group_size=4, questions_per_step=3, micro_batch_size=3, entropy_coef=0.01, max_grad_norm=1e9)
    expected = _full_vocab_gradient(tiny_causal_lm(32), groups, spec)
    trainer = GRPOTrainer(tiny_causal_lm(32), None, spec, temperature=TEMPERATURE)
    captured = []
    original = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: (
        captured.append(torch.cat([p.grad.reshape(-1).clone() for p in trainer.params])),
        original(*a, **k),
    )
    trainer.train_step(groups, 0)
    assert expected.abs().max() > 1e-3
    assert torch.allclose(captured[0], expected, atol=1e-7, rtol=1e-5)


def test_masked_logprobs_equal_the_full_softmax_at_loss_positions() -> None:
    model = tiny_causal_lm(32, seed=2)
    samples = trainable_samples(_ragged_groups(), current_version=0, max_policy_lag=0, scale_rewards=True).samples
    mb = collate(samples[:5], 0)
    got = masked_token_logprobs(model, mb, temperature=TEMPERATURE, entropy=True)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1] / TEMPERATURE
    assert torch.allclose(got.logp[mb.mask], token_logprobs(logits, mb.targets)[mb.mask], atol=1e-6)
    assert torch.allclose(got.entropy[mb.mask], token_entropy(logits)[mb.mask], atol=1e-5)
    assert not got.logp[~mb.mask].any() and not got.entropy[~mb.mask].any()


def test_bf16_autocast_body_keeps_an_fp32_head_and_stays_close() -> None:
    model = tiny_causal_lm(32, seed=3)
    samples = trainable_samples(_ragged_groups(), current_version=0, max_policy_lag=0, scale_rewards=True).samples
    mb = collate(samples, 0)
    fp32 = masked_token_logprobs(model, mb).logp
    bf16 = masked_token_logprobs(model, mb, autocast_dtype=torch.bfloat16).logp
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32)[mb.mask].abs().max() < 0.05
    # and a whole bf16 step trains: fp32 master weights, a finite loss
    trainer = GRPOTrainer(model, None, GRPOSpec(group_size=4, questions_per_step=3), compute_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    stats = trainer.train_step(_ragged_groups(), 0)
    assert stats.updated and abs(stats.importance_weight - 1.0) < 0.05


def test_the_heads_forward_stays_fp32_and_its_backward_runs_in_the_autocast_dtype() -> None:
    head = torch.nn.Linear(64, 1_000, bias=False)
    hidden = torch.randn(50, 64, generator=torch.Generator().manual_seed(6)).bfloat16().requires_grad_()
    targets = torch.randint(0, 1_000, (50,), generator=torch.Generator().manual_seed(7))

    def run(grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        logits = _head_logits(head, hidden, TEMPERATURE, grad_dtype)
        token_logprobs(logits, targets).sum().backward()
        return logits.detach(), hidden.grad.float(), head.weight.grad.clone()

    exact, fast = run(None), run(torch.bfloat16)
    assert fast[0].dtype == torch.float32 and torch.equal(fast[0], exact[0])  # the log-probs are read off these
    for got, expected in zip(fast[1:], exact[1:], strict=True):
        assert not torch.equal(got, expected)  # the bf16 products did run
        assert (got - expected).norm() / expected.norm() < 1e-2  # within bf16 rounding
    with torch.no_grad():
        assert torch.equal(_head_logits(head, hidden, TEMPERATURE, torch.bfloat16), exact[0])


def _samples() -> list[Sample]:
    return trainable_samples(_ragged_groups(), current_version=0, max_policy_lag=0, scale_rewards=True).samples


def _scored_with_gradient(model, mb, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    got = masked_token_logprobs(model, mb, temperature=TEMPERATURE, entropy=True, **kwargs)
    (got.logp.sum() + got.entropy.sum()).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return got.logp.detach(), got.entropy.detach(), grad


def test_a_shared_prompt_computed_once_gives_the_whole_rows_logprobs_and_gradients() -> None:
    model = tiny_causal_lm(32, seed=5)
    (group, *_) = prompt_micro_batches(_samples(), 4)
    shared, whole = collate(group, 0, share_prefix=True), collate(group, 0)
    # the prompt but its last token, whose logits predict the first generated token
    assert (shared.shared_prefix, whole.shared_prefix) == (PROMPT - 1, 0)
    for got, expected in zip(_scored_with_gradient(model, shared), _scored_with_gradient(model, whole), strict=True):
        assert expected.abs().max() > 1e-3
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    bf16 = _scored_with_gradient(model, shared, autocast_dtype=torch.bfloat16)[0]
    assert (bf16 - _scored_with_gradient(model, whole)[0])[shared.mask].abs().max() < 0.05


def test_a_shared_prompt_is_not_used_through_checkpointed_layers() -> None:
    # Checkpointed layers drop the cache they are given while training: the prompt's keys and
    # values would silently go missing, so such a micro-batch runs its rows whole.
    model = tiny_causal_lm(32, seed=6)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    (group, *_) = prompt_micro_batches(_samples(), 4)
    got = _scored_with_gradient(model, collate(group, 0, share_prefix=True))
    expected = _scored_with_gradient(model, collate(group, 0))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True))


def _sample(tokens: list[int], first_generated: int) -> Sample:
    mask = [0] * first_generated + [1] * (len(tokens) - first_generated)
    return Sample(tokens, mask, [0.0] * len(tokens), advantage=1.0)


def test_the_shared_prefix_stops_before_a_difference_and_before_the_first_generated_token() -> None:
    prompt = list(range(10, 30))
    a, b = _sample([*prompt, 1, 2], 20), _sample([*prompt, 1, 3], 20)
    assert shared_prefix_length([a, b]) == 19  # the generated tokens agree, but carry loss
    assert shared_prefix_length([a]) == 0  # nothing to share
    assert shared_prefix_length([a, _sample([*prompt[:12], 99, *prompt[13:], 1], 20)]) == 12
    assert shared_prefix_length([a, _sample([*prompt[:5], 99, *prompt[6:], 1], 20)]) == 0  # too short to pay
    assert shared_prefix_length([a, _sample([*prompt, 1, 2], 15)]) == 14  # an earlier first generated token


def test_micro_batches_keep_a_prompt_together_longest_first() -> None:
    one, two = list(range(10, 30)), list(range(40, 60))
    samples = [_sample([*p, *[5] * n], 20) for p, n in [(one, 1), (two, 4), (one, 3), (two, 2), (one, 2)]]
    batches = prompt_micro_batches(samples, 2)
    assert [[len(s.token_ids) - 20 for s in mb] for mb in batches] == [[3, 2], [1], [4, 2]]
    assert [collate(mb, 0, share_prefix=True).shared_prefix for mb in batches] == [19, 0, 19]
