"""Generation engines behind one interface: transformers (`hf`) and vLLM (`vllm`)."""

from __future__ import annotations

from typing import Literal

from rljob.config import ModelSpec
from rljob.engines.base import Completion, GenerationEngine, TurnParams


def load_engine(
    spec: ModelSpec, engine: Literal["hf", "vllm"] = "hf", device: str = "cpu", seed: int = 0, **kwargs: object
) -> GenerationEngine:
    """Build the engine a job asks for; vLLM is imported only when chosen."""
    if engine == "hf":
        from rljob.engines.hf import HFEngine

        return HFEngine.from_spec(spec, device=device, seed=seed, **kwargs)
    if engine == "vllm":
        from rljob.engines.vllm_engine import VLLMEngine

        return VLLMEngine(spec, seed=seed, **kwargs)  # vLLM places the model on the pod's GPUs itself
    raise ValueError(f"unknown engine {engine!r}; expected 'hf' or 'vllm'")


__all__ = ["Completion", "GenerationEngine", "TurnParams", "load_engine"]
