"""bf16 linear layers with weights reordered once for oneDNN: the same products as torch's linear,
the same Parameters, and a fresh reorder after any in-place weight write (a weight sync)."""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import load_questions
from rljob.engines import hf
from rljob.engines.base import TurnParams
from rljob.engines.hf import HFEngine
from rljob.engines.packed_linear import PackedLinear, pack_linears, packing_supported
from rljob.weights.apply import write_full
from support.tiny_models import tiny_random_model, train_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.zeros(1, dtype=torch.bfloat16)), reason="this torch has no oneDNN bf16 linear"
)


def _linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
    return layer


def _assert_same_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal on CPUs where oneDNN runs one kernel for both; never more than bf16 rounding apart."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576)])
def test_packed_products_equal_torch_linear_at_every_batch_shape(shape):
    plain = _linear(*shape)
    packed = PackedLinear(plain)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 3, 17, 64, 300):
            x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
            _assert_same_product(packed(x), plain(x))
            _assert_same_product(packed(x.view(1, rows, -1)), plain(x.view(1, rows, -1)))  # [batch, seq, hidden]


def test_an_in_place_weight_write_is_seen_by_the_next_forward():
    plain = _linear(64, 32)
    packed = PackedLinear(plain)
    x = torch.randn(8, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = packed(x)
    write_full(plain.weight, (torch.randn(64, 32) * 0.05).to(torch.bfloat16))  # what a full weight sync does
    with torch.inference_mode():
        after = packed(x)
        _assert_same_product(after, torch.nn.functional.linear(x, plain.weight))
    assert not torch.equal(before, after)
    plain.weight = torch.nn.Parameter((torch.randn(64, 32) * 0.05).to(torch.bfloat16))  # a new Parameter
    packed.weight = plain.weight
    with torch.inference_mode():
        _assert_same_product(packed(x), torch.nn.functional.linear(x, plain.weight))


def test_packing_keeps_the_models_parameters_and_ties():
    tokenizer = train_tiny_tokenizer(["a tiny corpus for a tiny tokenizer", "with two lines"], vocab_size=300)
    model = tiny_random_model(tokenizer).to(torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    names = dict(model.named_parameters())
    keys = list(model.state_dict())
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())

    assert pack_linears(model) == linears > 0
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in names.items()}
    assert list(model.state_dict()) == keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_used_layer_can_be_copied_and_the_copy_computes_the_same():
    layer = PackedLinear(_linear(64, 32))
    x = torch.randn(8, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = layer(x)  # the reordered weight now exists, and cannot be copied itself
    twin = copy.deepcopy(layer)
    assert twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)
    with torch.inference_mode():
        assert torch.equal(twin(x), want)
        made_here = copy.deepcopy(layer)  # its weight is an inference tensor: torch's own path
        assert made_here.weight.is_inference()
        _assert_same_product(made_here(x), want)


def test_fp32_layers_and_gradients_take_torchs_own_path():
    fp32 = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert pack_linears(fp32) == 0 and type(fp32[0]) is torch.nn.Linear
    layer = PackedLinear(_linear(16, 8))
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()  # with autograd on, the plain linear (whose backward exists) runs
    assert x.grad is not None and layer.weight.grad is not None


def test_engine_with_packed_weights_generates_what_it_did_without(monkeypatch):
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=40)
    tokenizer = train_tiny_tokenizer([q.question for q in questions], vocab_size=400)
    model = tiny_random_model(tokenizer, hidden=64, seed=3).to(torch.bfloat16)
    contexts = [tokenizer.encode(q.question) for q in questions[:3] for _ in range(2)]
    params = TurnParams(max_new_tokens=[12] * len(contexts), temperature=1.0)

    packed_engine = HFEngine(model, tokenizer, seed=5)
    assert any(isinstance(m, PackedLinear) for m in packed_engine.model.modules())
    packed = packed_engine.generate(contexts, params)

    monkeypatch.setattr(hf, "pack_linears", lambda module: 0)
    plain_model = tiny_random_model(tokenizer, hidden=64, seed=3).to(torch.bfloat16)
    plain = HFEngine(plain_model, tokenizer, seed=5).generate(contexts, params)
    for a, b in zip(packed, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-2)
