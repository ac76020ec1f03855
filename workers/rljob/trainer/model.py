"""Loading the policy the trainer optimises (fp32 master weights).

The trainer needs no tokenizer: rollout workers tokenise, trajectories arrive as token ids. It only
needs a pad id, which never reaches the loss.
"""

from __future__ import annotations

import torch

from rljob.config import ModelSpec


def load_policy(spec: ModelSpec) -> torch.nn.Module:
    """The policy model in fp32 from a hub name, a local directory or a GGUF file (dequantised).

    Loaded exactly as the rollout engines load it (`rljob.engines.models.load_model`), so both
    sides load the same weights; only the dtype differs (fp32 master weights here).
    """
    from rljob.engines.models import load_model

    return load_model(spec.model_copy(update={"dtype": "float32"}))


def disable_dropout(model: torch.nn.Module) -> None:
    """Switch dropout off in place, keeping train mode.

    The behaviour policy is the engine's model, which runs without dropout; scored with dropout,
    the trainer's policy is another one, and the clipped ratio, the importance weight and the KL
    see noise where there is no lag. Train mode stays on, because transformers checkpoints
    activations only in train mode. Covers `nn.Dropout` modules and the float `attention_dropout` /
    `dropout` attributes that Llama-style attention reads when training.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def pad_token_id_of(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0
