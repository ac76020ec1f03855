"""The engine's decode attention and in-place KV cache against torch's and transformers' own."""

from __future__ import annotations

import pytest
import torch

from rljob.engines.attention import grouped_decode_attention, grouped_prefill_attention
from rljob.engines.kv_cache import GrowingCache, GrowingLayer


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("queries", [1, 3])
def test_grouped_decode_attention_equals_sdpa(mask_kind: str, queries: int) -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, length, d = 4, 6, 2, 13, 8
    q = torch.randn(b, h, queries, d, generator=gen)
    k = torch.randn(b, hkv, length, d, generator=gen)
    v = torch.randn(b, hkv, length, d, generator=gen)
    keep = torch.rand(b, 1, queries, length, generator=gen) > 0.3
    keep[..., -1] = True  # every query sees at least one key
    mask = {"none": None, "bool": keep, "float": torch.where(keep, 0.0, float("-inf"))}[mask_kind]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert torch.allclose(grouped_decode_attention(q, k, v, mask, 0.3), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "one row"])
def test_grouped_prefill_attention_equals_transformers_sdpa(mask_kind: str, dtype: torch.dtype) -> None:
    """Stacking a key/value head's query heads as one longer query changes values by float
    rounding only (on the machines measured, bf16 outputs were identical)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(1)
    b, h, hkv, queries, length, d = 3, 6, 2, 5, 11, 8
    q, k, v = (
        torch.randn(b, n, s, d, generator=gen).to(dtype) for n, s in ((h, queries), (hkv, length), (hkv, length))
    )
    keep = torch.ones(b, 1, queries, length, dtype=torch.bool).tril(length - queries)
    keep[0, ..., :3] = False  # left padding of one row
    keep[2, ..., 4:6] = False  # a hole inside another
    mask = {"bool": keep, "float": torch.where(keep, 0.0, float("-inf")).to(dtype), "one row": keep[:, :, -1:]}[
        mask_kind
    ]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, h // hkv
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got = grouped_prefill_attention(q, k, v, mask, 0.3)
    assert got.dtype == dtype and (got.float() - expected.float()).abs().max() <= (
        1e-6 if dtype == torch.float32 else 0
    )


def _filled(rows: int, length: int, seed: int) -> tuple[GrowingCache, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    cache, keys = GrowingCache(), []
    for step in range(length):  # one token at a time, past the first buffer's spare room
        k = torch.randn(rows, 2, 1, 4, generator=gen)
        cache.update(k, -k, 0)
        keys.append(k)
        assert cache.get_seq_length() == step + 1
    return cache, keys


def test_growing_cache_appends_in_place_and_equals_concatenation() -> None:
    cache, keys = _filled(3, 150, seed=1)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.key_buffer.shape[2] > 150
    assert torch.equal(layer.keys, torch.cat(keys, dim=2)) and torch.equal(layer.values, -torch.cat(keys, dim=2))
    cache.batch_select_indices(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.layers[0].keys, torch.cat(keys, dim=2)[[2, 0, 0]])


def test_split_off_and_merge_put_every_row_back_with_zero_padding() -> None:
    cache, keys = _filled(5, 20, seed=2)
    full = torch.cat(keys, dim=2)
    part = cache.split_off([1, 3])
    assert torch.equal(part.layers[0].keys, full[[1, 3]]) and torch.equal(cache.layers[0].keys, full[[0, 2, 4]])
    extra = torch.randn(3, 2, 4, 4)
    cache.update(extra, extra, 0)  # the kept rows decode on
    merged = GrowingCache.merge([(part, [1, 3]), (cache, [0, 2, 4])], 5)
    keys_out = merged.layers[0].keys
    assert keys_out.shape == (5, 2, 24, 4)
    assert torch.equal(keys_out[[0, 2, 4], :, :20], full[[0, 2, 4]]) and torch.equal(keys_out[[0, 2, 4], :, 20:], extra)
    assert torch.equal(keys_out[[1, 3], :, :20], full[[1, 3]]) and not keys_out[[1, 3], :, 20:].any()


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_decode_attention_on_whole_cache_buffers_equals_the_cached_length(mask_kind: str) -> None:
    """Decode attention reads the growing cache's buffers whole and masks their spare positions."""
    from rljob.engines.attention import rljob_attention_forward, whole_buffers

    gen = torch.Generator().manual_seed(3)
    cache = GrowingCache()
    k, v = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    keys, values = cache.update(k, v, 0)
    assert not keys.is_contiguous()  # a view of a buffer with spare room
    q = torch.randn(2, 4, 1, 8, generator=gen)
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[0, ..., :2] = False
    mask = {"none": None, "bool": keep, "float": torch.where(keep, 0.0, float("-inf"))}[mask_kind]
    kb, vb, wide = whole_buffers(keys, values, mask, 1)
    assert kb.shape[2] > 5 and wide.shape[-1] == kb.shape[2] and kb.is_contiguous() and vb.shape == kb.shape
    assert torch.equal(kb[:, :, :5], keys) and not kb[:, :, 5:].any()
    module = torch.nn.Module()
    got, _ = rljob_attention_forward(module, q, keys, values, mask, scaling=0.25)
    expected = grouped_decode_attention(q, keys.contiguous(), values.contiguous(), mask, 0.25)
    assert torch.allclose(got, expected, atol=1e-6)
