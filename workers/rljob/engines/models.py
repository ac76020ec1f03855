"""Load a policy model and its tokenizer: hub name, local folder, GGUF file, or a tiny random model.

The serving dtype is `spec.model.dtype` as `rljob.precision` reads it: with `auto`, bf16 on CUDA
and on CPUs with native bf16 matrix products, fp32 on other CPUs. The weight store's values are
bf16, so a bf16 engine takes them as they are and an fp32 one holds them exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rljob.config import ModelSpec
from rljob.precision import compute_dtype


def serving_dtype(spec: ModelSpec, device: str | torch.device) -> torch.dtype:
    return compute_dtype(spec.dtype, device)


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
    model = AutoModelForCausalLM.from_pretrained(name, dtype=serving_dtype(spec, device), **kwargs)
    return model.to(device).eval()


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on the fly (tests: no hub, seconds to build)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")


def tiny_random_model(tokenizer: Any, hidden: int = 32, layers: int = 2, seed: int = 0) -> Any:
    """A Llama-shaped model with random weights sized for the tokenizer (float32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_tiny_model(folder: str | Path, texts: Iterable[str], vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a tiny random model + tokenizer folder loadable as ModelSpec(name=folder)."""
    folder = Path(folder)
    tokenizer = train_tiny_tokenizer(texts, vocab_size)
    tiny_random_model(tokenizer, seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
