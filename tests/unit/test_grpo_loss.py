"""The GRPO token loss against hand-computed values; masked tokens get exactly zero gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rljob.trainer.loss import aggregate, grpo_token_terms, k3_kl, token_entropy, token_logprobs

E = math.exp


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _case() -> dict[str, torch.Tensor]:
    return {
        "logp": torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], dtype=torch.float64, requires_grad=True),
        "prox": torch.tensor([[-1.0, -2.5, -0.5], [-1.5, -0.1, -3.0]], dtype=torch.float64),
        # masked positions carry 0.0 (the protocol's filler) or absurd values: neither may matter
        "behaviour": torch.tensor([[-1.2, -3.5, 0.0], [900.0, -0.1, -2.9]], dtype=torch.float64),
        "adv": torch.tensor([1.0, -2.0], dtype=torch.float64),
        "mask": torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool),
    }


def test_clipped_truncated_surrogate_matches_hand_computation() -> None:
    c = _case()
    terms = grpo_token_terms(c["logp"], c["prox"], c["behaviour"], c["adv"], c["mask"], clip_epsilon=0.2, ratio_cap=2.0)
    w00 = E(-1.0 + 1.2)  # proximal / behaviour, under the cap
    w01 = 2.0  # exp(1.0) = 2.72 truncated to the cap
    w11 = 1.0
    w12 = E(-3.0 + 2.9)
    r01 = E(0.5)  # outside 1 + eps with A > 0: the clipped branch (1.2) wins
    r11 = E(-0.1)  # inside the clip range
    expected = torch.tensor(
        [[-w00 * 1.0 * 1.0, -w01 * 1.2 * 1.0, 0.0], [0.0, -w11 * r11 * -2.0, -w12 * 1.0 * -2.0]],
        dtype=torch.float64,
    )
    assert torch.allclose(terms.loss, expected, atol=1e-12)
    assert terms.clipped.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert terms.truncated.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert terms.ratio[0, 1].item() == pytest.approx(r01)

    loss = aggregate(terms.loss, c["mask"], "token-mean", total_tokens=4, total_sequences=2)
    assert loss.item() == pytest.approx(float(expected.sum()) / 4, abs=1e-12)
    loss.backward()
    # d/dlogp of -w * r * A is -w * r * A; zero where clipped; exactly zero where masked.
    grad = torch.tensor([[-w00 * 1.0 / 4, 0.0, 0.0], [0.0, 2.0 * w11 * r11 / 4, 2.0 * w12 / 4]], dtype=torch.float64)
    assert torch.allclose(c["logp"].grad, grad, atol=1e-12)
    assert c["logp"].grad[~c["mask"]].eq(0).all()


def test_negative_advantage_clips_below() -> None:
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[-0.5]], dtype=torch.float64)  # r = exp(-0.5) = 0.607 < 1 - eps
    terms = grpo_token_terms(
        logp,
        prox,
        prox,
        torch.tensor([-1.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_epsilon=0.2,
        ratio_cap=2.0,
    )
    assert terms.loss.item() == pytest.approx(0.8)  # -(1) * min(-0.607, -0.8) = 0.8
    terms.loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_sequence_mean_averages_within_then_across_sequences() -> None:
    token_loss = torch.tensor([[1.0, 3.0, 100.0], [6.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(token_loss, mask, "sequence-mean", total_tokens=3, total_sequences=2).item() == 4.0
    assert aggregate(token_loss, mask, "token-mean", total_tokens=3, total_sequences=2).item() == pytest.approx(10 / 3)
    # the step's totals, not the micro-batch's, are the normaliser
    assert aggregate(token_loss, mask, "token-mean", total_tokens=6, total_sequences=4).item() == pytest.approx(10 / 6)


def test_k3_kl_and_entropy_values() -> None:
    kl = k3_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]))
    assert kl[0].item() == pytest.approx(E(-0.5) + 0.5 - 1.0)
    assert kl[1].item() == 0.0
    uniform = torch.zeros(1, 1, 8)
    assert token_entropy(uniform).item() == pytest.approx(math.log(8))
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))


def test_token_logprobs_equal_the_log_softmax_at_the_target_with_its_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    for shape in [(7, 300), (2, 5, 300)]:
        logits = (torch.randn(shape, generator=gen) * 8).requires_grad_()
        targets = torch.randint(0, 300, shape[:-1], generator=gen)
        weights = torch.randn(shape[:-1], generator=gen)
        (token_logprobs(logits, targets) * weights).sum().backward()
        got, grad = token_logprobs(logits, targets).detach(), logits.grad.clone()
        logits.grad = None
        expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        (expected * weights).sum().backward()
        assert got.shape == targets.shape
        assert torch.allclose(got, expected.detach(), atol=1e-5)
        assert torch.allclose(grad, logits.grad, atol=1e-6)


def test_masked_positions_get_exactly_zero_gradient_through_every_term() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    logp = token_logprobs(logits, targets)
    behaviour = torch.where(mask, logp.detach() + 0.3 * torch.randn(3, 5, dtype=torch.float64), 0.0)
    ref = logp.detach() - 0.2
    terms = grpo_token_terms(
        logp,
        logp.detach() + 0.05,
        behaviour,
        torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
        mask,
        clip_epsilon=0.2,
        ratio_cap=2.0,
        ref_logp=ref,
        kl_coef=0.1,
        entropy=token_entropy(logits),
        entropy_coef=0.01,
    )
    aggregate(terms.loss, mask, "token-mean", total_tokens=int(mask.sum()), total_sequences=3).backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    assert grad[~mask].abs().max().item() == 0.0
    assert grad[mask].abs().sum(-1).gt(0).all()  # and every trained position does get a gradient


def test_kl_term_pulls_towards_reference() -> None:
    logp = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0]], dtype=torch.float64)
    terms = grpo_token_terms(
        logp,
        logp.detach(),
        logp.detach(),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_epsilon=0.2,
        ratio_cap=2.0,
        ref_logp=ref,
        kl_coef=0.5,
    )
    d = -0.5
    assert terms.loss.item() == pytest.approx(0.5 * (E(d) - d - 1))
    terms.loss.sum().backward()
    assert logp.grad.item() == pytest.approx(0.5 * (1 - E(d)))  # > 0: lowering logp lowers the loss
