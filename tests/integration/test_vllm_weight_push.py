"""The vLLM engine's weight path, everything but vLLM itself: a real publisher and reader on a real
redis-server decode versions into the engine's bf16 shadow, and the changed tensors go through the
engine's `collective_rpc` call into a model's `load_weights`.

vLLM cannot run here (it needs its CUDA wheel and a GPU), so `FakeLLM` and `FakeVLLMModel` stand in
for exactly two of its entry points: `LLM.collective_rpc` / `reset_prefix_cache`, and a vLLM
model's `load_weights(weights)` (HF names in, copied by name; vLLM's own loaders also fuse q/k/v and
gate/up, which this fake does not). tests/unit/test_engine_vllm.py runs the real thing on a GPU.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rljob.config import ModelSpec
from rljob.engines.vllm_engine import VLLMEngine
from rljob.keys import JobKeys
from rljob.weights import WeightPublisher, WeightReader
from rljob.weights.checksum import bf16_bits

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
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
    """Stands in for `vllm.LLM`'s `collective_rpc` (one worker, in process) and prefix-cache reset.

    As vLLM does: with the engine core in its default separate process, `collective_rpc` sends its
    arguments with msgpack, which refuses a Python function (vLLM 0.9-0.11 `serial_utils`); only
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the call in process with the tensors themselves."""

    def __init__(self, model: FakeVLLMModel) -> None:
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=model), device=torch.device("cpu"))
        self.prefix_cache_resets = 0
        self.fail_next_rpc: Exception | None = None

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
            raise TypeError(f"Object of type {type(method)} is not serializable")
        if self.fail_next_rpc is not None:
            error, self.fail_next_rpc = self.fail_next_rpc, None
            raise error
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1


@pytest.fixture(autouse=True)
def _vllm_environment(monkeypatch):
    """Whatever a test sets in vLLM's environment is undone after it."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)


def fake_vllm_module(monkeypatch, version: str, built: list[dict[str, Any]]) -> None:
    """A `vllm` module whose `LLM(**kwargs)` records its arguments and builds nothing."""

    def llm(**kwargs: Any) -> SimpleNamespace:
        built.append(
            {
                **kwargs,
                "env": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
            }
        )
        return SimpleNamespace(get_tokenizer=lambda: None)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=version, LLM=llm))


def engine_serving(served: torch.nn.Module, monkeypatch) -> tuple[VLLMEngine, FakeVLLMModel, FakeLLM]:
    """The real constructor against a fake `vllm` module, then the fake LLM in its place."""
    fake_vllm_module(monkeypatch, "0.11.0", [])
    engine = VLLMEngine(ModelSpec(name="unused"))
    model = FakeVLLMModel(served)
    llm = FakeLLM(model)
    engine.llm = llm
    engine._shadow = {name: t.detach().to(torch.bfloat16).clone() for name, t in served.named_parameters()}
    return engine, model, llm


def serving_setup(redis_client, monkeypatch, job: str):
    """A trainer model, the engine serving another one, and a publisher and reader between them."""
    trainer = tiny_llama(seed=0)
    served = tiny_llama(seed=1).to(torch.bfloat16)
    engine, model, llm = engine_serving(served, monkeypatch)
    keys = JobKeys("test", job)
    publisher = WeightPublisher(redis_client, keys, rebase_interval=10, rebase_fraction=4.0, chunk_bytes=4096)
    return trainer, served, engine, model, llm, publisher, WeightReader(redis_client, keys)


def test_versions_reach_the_served_model_through_load_weights(redis_client, monkeypatch):
    trainer, served, engine, model, llm, publisher, reader = serving_setup(redis_client, monkeypatch, "vllm-push")
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


def test_a_failed_push_is_pushed_again_with_the_next_sync(redis_client, monkeypatch):
    # The reader advances the shadow before the push: a push that failed left those tensors out of
    # the served model for good (the reader never reports them again) under the new version number.
    trainer, served, engine, model, llm, publisher, reader = serving_setup(redis_client, monkeypatch, "vllm-fails")
    publisher.publish(trainer)
    engine.sync_weights(reader)
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.25)
    publisher.publish(trainer)
    llm.fail_next_rpc = RuntimeError("a worker died")
    with pytest.raises(RuntimeError, match="a worker died"):
        engine.sync_weights(reader)
    assert engine.policy_version == 0  # not the version it failed to serve
    outcome = engine.sync_weights(reader)  # nothing new is published: only the missed push
    assert outcome.version == 1 and engine.policy_version == 1 and model.loaded[-1] == ["model.norm.weight"]
    expected = {name: bf16_bits(p) for name, p in trainer.named_parameters()}
    assert all(bf16_bits(p).tobytes() == expected[name].tobytes() for name, p in served.named_parameters())


@pytest.mark.parametrize(("version", "processed"), [("0.10.1.1", False), ("0.10.2", True), ("0.11.0+cu128", True)])
def test_the_engine_runs_vllm_in_process_and_asks_for_sampled_logprobs_where_vllm_gives_them(
    monkeypatch, version: str, processed: bool
):
    # In its default separate process vLLM cannot carry the weight push (see FakeLLM); and
    # 0.10.0-0.10.1 take `logprobs_mode` but compute those log-probs before temperature and top-p.
    built: list[dict[str, Any]] = []
    fake_vllm_module(monkeypatch, version, built)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = VLLMEngine(ModelSpec(name="m"), tensor_parallel_size=2)
    (kwargs,) = built
    assert kwargs["env"] == "0" and kwargs["tensor_parallel_size"] == 2
    assert engine.processed_logprobs is processed
    assert (kwargs.get("logprobs_mode") == "processed_logprobs") is processed
