"""Per-token log-probs of a micro-batch, with the output layer applied only where the loss is taken.

Most of a trajectory's positions carry no loss (the prompt, retrieved passages, padding), and a
small model's vocabulary projection is a large share of its FLOPs plus a [tokens, vocab] tensor.
For model families whose logits are the plain head of the last hidden state, the body runs on
every position (a prefix the rows share, their group's prompt, once) and the head only on the loss
positions; the others take the full forward, because many transform their logits inside it
(Granite's logits_scaling, Cohere's logit_scale, Gemma 2's soft-capping).

The body may run under autocast (bf16 on fast hardware). The head's product and the log-softmax
always run forward in fp32, since bf16 logits are too coarse for a softmax; under autocast the
head's backward products run in the autocast dtype, as every other layer's do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rljob.engines.models import cache_argument
from rljob.trainer.batch import MicroBatch
from rljob.trainer.loss import token_entropy, token_logprobs

# Model types whose forward computes logits as `lm_head(last hidden state)` and nothing more
# (checked in transformers' modeling code); SmolLM2 is "llama".
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})


@dataclass
class TokenLogprobs:
    logp: torch.Tensor  # [b, T-1] float32; 0 where mask is False
    entropy: torch.Tensor | None  # [b, T-1] float32 when asked for; 0 where mask is False


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEAD_MODELS
    if body is None or head is None or body is model or not plain:
        return None
    return body, head


def _checkpointing(module: torch.nn.Module) -> bool:
    """transformers drops a cache passed through a checkpointed layer while training."""
    return (
        module.training
        and torch.is_grad_enabled()
        and any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
    )


def _hidden_states(body: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, int]:
    """The body's last hidden states from position `start` on, and `start`.

    With a shared prefix of L tokens (`mb.shared_prefix`), those are computed once, on one row,
    and every row's own tokens attend to that row's keys and values, copied per row: the same
    values as a forward over every row whole, up to float rounding, in about L x (rows - 1)
    fewer token positions. Gradients reach the prefix through its keys and values.
    """
    shared = mb.shared_prefix
    if not shared or _checkpointing(body):
        out = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.last_hidden_state, 0
    name = cache_argument(body)
    rows, width = mb.input_ids.shape
    cache = getattr(body(input_ids=mb.input_ids[:1, :shared], use_cache=True), name)
    cache.batch_repeat_interleave(rows)
    positions = torch.arange(shared, width, device=mb.input_ids.device).expand(rows, -1)
    out = body(
        input_ids=mb.input_ids[:, shared:],
        attention_mask=mb.attention_mask,
        position_ids=positions,
        use_cache=True,
        **{name: cache},
    )
    return out.last_hidden_state, shared


class _HeadProduct(torch.autograd.Function):
    """`hidden @ weight.T` in fp32, whose backward runs its two products in `grad_dtype`.

    The forward stays fp32 because the log-probs (and the importance weights) are read off it; the
    backward's products are two thirds of the head's FLOPs, and autocast computes every other
    layer's gradients in that dtype already (fp32 accumulation, bf16 inputs).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
        ctx.grad_dtype = grad_dtype
        ctx.save_for_backward(hidden.to(grad_dtype), weight)
        return hidden @ weight.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight = ctx.saved_tensors
        low = grad.to(ctx.grad_dtype)
        grad_hidden = (low @ weight.to(ctx.grad_dtype)).float() if ctx.needs_input_grad[0] else None
        grad_weight = (low.T @ hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None


def _head_logits(
    head: torch.nn.Module, hidden: torch.Tensor, temperature: float, grad_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fp32 logits / temperature, dividing the hidden states (a few hundred wide) rather than the
    logits (vocabulary wide) when the head is a plain bias-free projection, whose backward then
    runs in `grad_dtype` (the body's autocast dtype) when one is given."""
    weight = getattr(head, "weight", None)
    if isinstance(head, torch.nn.Linear) and head.bias is None and isinstance(weight, torch.Tensor):
        scaled = hidden.float() / temperature
        if grad_dtype is not None and grad_dtype != torch.float32 and torch.is_grad_enabled():
            return _HeadProduct.apply(scaled, weight.float(), grad_dtype)
        return scaled @ weight.float().T
    return head(hidden.float()) / temperature


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def masked_token_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    temperature: float = 1.0,
    autocast_dtype: torch.dtype | None = None,
    entropy: bool = False,
) -> TokenLogprobs:
    """log p(target) (and the entropy) at the loss positions of `mb`, of softmax(logits / temperature).

    Gradients flow to the model; positions outside the mask get exact zeros and no gradient.
    """
    device = mb.input_ids.device
    parts = _body_and_head(model)
    if parts is None:
        with autocast_context(device, autocast_dtype):
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        logits = (out.logits if hasattr(out, "logits") else out)[:, :-1, :][mb.mask].float()  # [loss tokens, vocab]
        if temperature != 1.0:
            logits = logits / temperature
    else:
        body, head = parts
        with autocast_context(device, autocast_dtype):
            hidden, start = _hidden_states(body, mb)
        picked = hidden[:, :-1, :][mb.mask[:, start:]]  # [loss tokens, hidden], in `mb.mask` order
        with torch.autocast(device.type, enabled=False):
            logits = _head_logits(head, picked, temperature, autocast_dtype)  # [loss tokens, vocab], fp32
    logp = _scatter(token_logprobs(logits, mb.targets[mb.mask]), mb.mask)
    ent = _scatter(token_entropy(logits), mb.mask) if entropy else None
    return TokenLogprobs(logp, ent)
