"""Attention for the transformers engine's decode steps: plain matrix products instead of SDPA.

On CPU, torch's fused SDPA kernel is built for long queries. A decode step asks it for 1 query
row per sequence (a few per key/value head under grouped-query attention) against the whole cache,
and it spends most of a SmolLM2 decode step there (measured: `docs/results/step_speed.md`). Two
batched matmuls and a softmax do the same work at the cost of the arithmetic. Prefill (many query
rows) keeps SDPA, which is fast there, with the query heads that share a key/value head stacked
along the query axis: the kernel then reads each key/value head once, where transformers' path
with a mask first copies the cache once per query head (`repeat_kv`).

Registered under its own name so only models that ask for it use it; masks are built as for SDPA.
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION_NAME = "rljob_sdpa"
DECODE_QUERY_ROWS = 8  # up to this many new tokens a call takes the matmul path


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v for query [b, h, q, d], key/value [b, hkv, L, d] -> [b, q, h, d].

    The h query heads share hkv key/value heads in groups of h // hkv (no repeat of the cache).
    The mask is SDPA's: bool (True = attend) or additive float, broadcastable to [b, 1, q, L].
    Scores and the softmax are in fp32; the products run in the inputs' dtype.
    """
    b, h, q, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    groups = h // hkv
    packed = query.reshape(b, hkv, groups * q, d)  # heads of a group are adjacent
    scores = torch.matmul(packed, key.transpose(-1, -2)).float().mul_(scaling)
    scores = scores.view(b, hkv, groups, q, length)
    if attention_mask is not None:
        mask = attention_mask[:, :, None] if attention_mask.dim() == 4 else attention_mask
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
    probs = scores.softmax(-1).to(value.dtype).view(b, hkv, groups * q, length)
    out = torch.matmul(probs, value).view(b, h, q, d)
    return out.transpose(1, 2).contiguous()


def grouped_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """SDPA for query [b, h, q, d] against key/value [b, hkv, L, d] -> [b, q, h, d], the h // hkv
    query heads of a key/value head stacked as one query of (h // hkv) * q rows. The 4-D mask
    ([b, 1, q or 1, L]) must be given, as a causal mask cannot be left to the kernel once queries
    are stacked; it is repeated along the stacked rows."""
    b, h, q, d = query.shape
    groups = h // key.shape[1]
    packed = query.reshape(b, key.shape[1], groups * q, d)  # heads of a group are adjacent
    mask = attention_mask.expand(-1, -1, q, -1).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.view(b, h, q, d).transpose(1, 2).contiguous()


def rljob_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        dropout == 0.0
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and query.shape[1] % key.shape[1] == 0
    )
    if plain and query.shape[2] <= DECODE_QUERY_ROWS:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        key, value, attention_mask = whole_buffers(key, value, attention_mask, query.shape[2])
        return grouped_decode_attention(query, key, value, attention_mask, scale), None
    if plain and attention_mask is not None and attention_mask.dim() == 4:
        return grouped_prefill_attention(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _whole(view: torch.Tensor) -> torch.Tensor | None:
    """The contiguous [b, h, capacity, d] tensor that `view` ([b, h, length, d]) is the front of,
    or None. Read off the strides and the storage, as inference-mode views keep no `_base`."""
    if view.dim() != 4 or view.stride(3) != 1 or view.stride(2) != view.shape[3]:
        return None
    b, h, length, d = view.shape
    capacity = view.stride(1) // d
    if capacity <= length or view.stride(1) != capacity * d or view.stride(0) != h * capacity * d:
        return None
    needed = (view.storage_offset() + b * h * capacity * d) * view.element_size()
    if view.untyped_storage().nbytes() < needed:
        return None
    return view.as_strided((b, h, capacity, d), (h * capacity * d, capacity * d, d, 1))


def whole_buffers(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, queries: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The in-place cache's buffers whole, with the mask widened to cover their spare positions.

    Keys and values from `kv_cache.GrowingLayer` are views `buffer[:, :, :length]`, which a bf16
    matmul reads several times slower than the contiguous buffers (docs/results/step_speed.md);
    their spare positions hold zeros, and the mask gives them no weight. Anything else passes through.
    """
    kb, vb = _whole(key), _whole(value)
    if kb is None or vb is None or kb.shape != vb.shape:
        return key, value, mask
    length, capacity = key.shape[2], kb.shape[2]
    if mask is None:
        mask = torch.ones((key.shape[0], 1, queries, length), dtype=torch.bool, device=key.device)
    spare = (*mask.shape[:-1], capacity - length)
    if mask.dtype == torch.bool:
        pad = torch.zeros(spare, dtype=torch.bool, device=mask.device)
    else:
        pad = torch.full(spare, float("-inf"), dtype=mask.dtype, device=mask.device)
    return kb, vb, torch.cat([mask, pad], dim=-1)


def register() -> str:
    """Make `attn_implementation=ATTENTION_NAME` available to transformers models (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, rljob_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
