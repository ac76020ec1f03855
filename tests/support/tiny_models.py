"""Tiny random Llama models with a BPE tokenizer trained on the given texts: seconds to build, loadable
as `ModelSpec(name=folder)`, for tests that need a real transformers model but not a good one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


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


def tiny_causal_lm(vocab_size: int = 64, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama small enough to train in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()
