"""Load a policy model and its tokenizer: hub name, local folder or GGUF file.

The serving dtype is `spec.model.dtype` as `rljob.precision` reads it: with `auto`, bf16 on CUDA
and on CPUs with native bf16 matrix products, fp32 on other CPUs. The weight store's values are
bf16, so a bf16 engine takes them as they are and an fp32 one holds them exactly.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from rljob.config import ModelSpec
from rljob.precision import compute_dtype


def cache_argument(module: torch.nn.Module) -> str:
    """The name of a transformers model's KV-cache argument and output: transformers 5 renamed
    `past_key_values` to `cache` (the old name is deprecated)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def model_source(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """(path-or-name, extra from_pretrained kwargs) for the spec; a `.gguf` name is split."""
    kwargs: dict[str, Any] = {}
    name = spec.name
    if name.endswith(".gguf"):
        path = Path(name)
        name, kwargs["gguf_file"] = str(path.parent), path.name
    elif spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    if spec.revision and not Path(name).exists():
        kwargs["revision"] = spec.revision
    return name, kwargs


def load_tokenizer(spec: ModelSpec) -> Any:
    from transformers import AutoTokenizer

    name, kwargs = model_source(spec)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: ModelSpec, device: str | torch.device = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    name, kwargs = model_source(spec)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=compute_dtype(spec.dtype, device), **kwargs)
    return model.to(device).eval()
