"""A KV cache for the transformers engine that appends in place and can set rows aside.

transformers' `DynamicLayer` grows by `torch.cat` on every call, copying the whole cache once per
decoded token. Here each layer keeps its keys and values in a buffer with spare room along the
sequence axis: an append writes into it, and the buffer is copied only when it fills up (it grows
by 64 positions, about once a turn) or when rows are selected. The cached keys and values are views
of the buffers; decode attention reads the buffers whole (a contiguous tensor multiplies several
times faster in bf16 than a strided view of one) and masks the spare positions. `split_off` moves
finished rows out of the batch so later decode steps stop computing them, and `merge` puts every
row back, in the original order, for the next turn's cache reuse. Rows shorter than the merged
length are padded with zeros; the engine's attention mask marks those positions as holes, as it
already does for padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

_GROW_TOKENS = 64  # spare positions a fresh or copied buffer gets beyond what it holds


def _buffer(like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """Zeros, not `empty`: decode attention reads the whole buffer (`attention.py`) and masks the
    positions past the cached length, which must therefore hold finite values."""
    return torch.zeros((rows, like.shape[1], capacity, like.shape[3]), dtype=like.dtype, device=like.device)


class GrowingLayer(DynamicLayer):
    """One layer's keys/values [batch, heads, length, dim] as views of a larger buffer."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self.key_buffer = _buffer(key_states, key_states.shape[0], key_states.shape[2] + _GROW_TOKENS)
        self.value_buffer = _buffer(value_states, value_states.shape[0], value_states.shape[2] + _GROW_TOKENS)
        self.is_initialized = True
        self._views()

    @classmethod
    def from_buffers(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> GrowingLayer:
        layer = cls()
        layer.device, layer.is_initialized = keys.device, True
        layer._set(keys, values, length)
        return layer

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def _set(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.key_buffer, self.value_buffer, self.length = keys, values, length
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[2]
        if end > self.key_buffer.shape[2]:
            capacity = end + _GROW_TOKENS  # decode attention reads the spare room too: keep it small
            keys = _buffer(self.key_buffer, self.key_buffer.shape[0], capacity)
            values = _buffer(self.value_buffer, self.value_buffer.shape[0], capacity)
            keys[:, :, :start] = self.keys
            values[:, :, :start] = self.values
            self.key_buffer, self.value_buffer = keys, values
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.length = max(self.length + tokens_to_remove, 0)
            self._views()

    def select_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given rows (in that order), with spare room, as new buffers."""
        keys = _buffer(self.key_buffer, len(rows), self.length + _GROW_TOKENS)
        values = _buffer(self.value_buffer, len(rows), self.length + _GROW_TOKENS)
        keys[:, :, : self.length] = self.keys.index_select(0, rows)
        values[:, :, : self.length] = self.values.index_select(0, rows)
        return keys, values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            keys, values = self.select_rows(indices.to(self.device))
            self._set(keys, values, self.length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.keys.shape[0], device=self.device).repeat_interleave(repeats)
            self.batch_select_indices(rows)


class GrowingCache(Cache):
    """A cache of `GrowingLayer`s (created on the first forward, one per attention layer)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=GrowingLayer)

    @property
    def rows(self) -> int:
        return self.layers[0].keys.shape[0] if self.layers and self.layers[0].is_initialized else 0

    def split_off(self, rows: Sequence[int]) -> GrowingCache:
        """Move `rows` into a new cache (in that order); this one keeps the others, in order."""
        moving = set(rows)
        moved = torch.tensor(list(rows), dtype=torch.long)
        keep = torch.tensor([r for r in range(self.rows) if r not in moving], dtype=torch.long)
        part = GrowingCache()
        for layer in self.layers:
            part.layers.append(GrowingLayer.from_buffers(*layer.select_rows(moved.to(layer.device)), layer.length))
            layer.batch_select_indices(keep)
        return part

    @staticmethod
    def merge(parts: Sequence[tuple[GrowingCache, Sequence[int]]], total_rows: int) -> GrowingCache:
        """One cache holding every part's rows at the given positions, padded to the longest part.

        Padding positions hold zeros (finite, so a masked position can never turn into a NaN).
        """
        merged = GrowingCache()
        for index in range(len(parts[0][0].layers)):
            layers = [part.layers[index] for part, _ in parts]
            length = max(layer.length for layer in layers)
            keys = _buffer(layers[0].key_buffer, total_rows, length + _GROW_TOKENS)
            values = _buffer(layers[0].value_buffer, total_rows, length + _GROW_TOKENS)
            for layer, (_, rows) in zip(layers, parts, strict=True):
                at = torch.tensor(list(rows), dtype=torch.long, device=keys.device)
                keys[at, :, : layer.length] = layer.keys
                values[at, :, : layer.length] = layer.values
            merged.layers.append(GrowingLayer.from_buffers(keys, values, length))
        return merged
