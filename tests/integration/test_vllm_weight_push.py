"""The vLLM engine's weight path, everything but vLLM itself: a real publisher and reader on a real
redis-server decode versions into the engine's bf16 shadow, and the changed tensors go through the
engine's `collective_rpc` call into a model's `load_weights`.

vLLM cannot run here (it needs its CUDA wheel and a GPU), so `FakeLLM` and `FakeVLLMModel` stand in
for exactly two of its entry points: `LLM.collective_rpc` / `reset_prefix_cache`, and a vLLM
model's `load_weights(weights)` (HF names in, copied by name; vLLM's own loaders also fuse q/k/v and
gate/up, which this fake does not). tests/unit/test_engine_vllm.py runs the real thing on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rljob.engines.vllm_engine import VLLMEngine
from rljob.keys import JobKeys
from rljob.weights import WeightPublisher, WeightReader
from rljob.weights.checksum import bf16_bits

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class FakeVLLMModel:
    """Stands in for a vLLM model's `load_weights` (vLLM cannot run here): copies by HF name."""

    def __init__(self, served: torch.nn.Module) -> None:
        self.served = served
        self.loaded: list[list[str]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.served.named_parameters())
        self.loaded.append([name for name, _ in weights])
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


class FakeLLM:
    """Stands in for `vllm.LLM`'s `collective_rpc` (one worker, in process) and prefix-cache reset."""

    def __init__(self, model: FakeVLLMModel) -> None:
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=model), device=torch.device("cpu"))
        self.prefix_cache_resets = 0

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1


def engine_serving(served: torch.nn.Module) -> tuple[VLLMEngine, FakeVLLMModel, FakeLLM]:
    model = FakeVLLMModel(served)
    llm = FakeLLM(model)
    engine = VLLMEngine.__new__(VLLMEngine)  # skips vllm.LLM(...); the weight path is all real
    engine.llm, engine.policy_version = llm, 0
    engine._shadow = {name: t.detach().to(torch.bfloat16).clone() for name, t in served.named_parameters()}
    return engine, model, llm


def test_versions_reach_the_served_model_through_load_weights(redis_client):
    trainer = tiny_llama(seed=0)
    served = tiny_llama(seed=1).to(torch.bfloat16)
    engine, model, llm = engine_serving(served)
    keys = JobKeys("test", "vllm-push")
    publisher = WeightPublisher(redis_client, keys, rebase_interval=10, rebase_fraction=4.0, chunk_bytes=4096)
    reader = WeightReader(redis_client, keys)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)

    def served_matches_trainer() -> bool:
        expected = {name: bf16_bits(p) for name, p in trainer.named_parameters()}
        held = {name: bf16_bits(p) for name, p in served.named_parameters()}
        return all(held[name].tobytes() == bits.tobytes() for name, bits in expected.items())

    publisher.publish(trainer)  # version 0: a full
    outcome = engine.sync_weights(reader)
    assert outcome.version == 0 and outcome.took_full
    assert served_matches_trainer() and llm.prefix_cache_resets == 1
    assert sorted(model.loaded[-1]) == sorted(name for name, _ in trainer.named_parameters())

    with torch.no_grad():  # version 1: a delta that touches one tensor only
        trainer.model.norm.weight.add_(0.25)
    publisher.publish(trainer)
    outcome = engine.sync_weights(reader)
    assert outcome.version == 1 and not outcome.took_full and engine.policy_version == 1
    assert model.loaded[-1] == ["model.norm.weight"], "only the tensors the delta changed are pushed"
    assert served_matches_trainer() and llm.prefix_cache_resets == 2

    ids = torch.randint(0, 128, (2, 8))  # version 2: a real optimizer step
    trainer(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    publisher.publish(trainer)
    outcome = engine.sync_weights(reader)
    assert outcome.version == 2 and served_matches_trainer() and llm.prefix_cache_resets == 3

    publisher.publish(trainer)  # version 3: nothing changed, nothing is pushed
    pushes = len(model.loaded)
    outcome = engine.sync_weights(reader)
    assert outcome.version == 3 and engine.policy_version == 3
    assert len(model.loaded) == pushes and llm.prefix_cache_resets == 3
