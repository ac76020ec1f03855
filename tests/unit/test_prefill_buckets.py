"""Length buckets for the engine's prefill: the partition and its cost (the engine's use of it is
tested with the engine, in test_engine_hf)."""

from __future__ import annotations

import pytest
import torch

from rljob.engines.buckets import length_buckets


def _padded(lengths, buckets) -> int:
    return sum(len(b) * max(lengths[r] for r in b) for b in buckets)


def test_one_long_row_gets_a_forward_of_its_own():
    lengths = [42] * 61 + [113]
    buckets = length_buckets(lengths, overhead=256)
    assert buckets == [list(range(61)), [61]]
    assert _padded(lengths, buckets) == 61 * 42 + 113


def test_similar_lengths_stay_in_one_forward():
    lengths = [155, 160, 160, 160, 161, 165, 167, 168]
    assert length_buckets(lengths, overhead=256) == [sorted(range(8), key=lengths.__getitem__)]


@pytest.mark.parametrize("overhead", [0, 10, 100])
def test_buckets_partition_the_rows_at_the_least_cost(overhead):
    generator = torch.Generator().manual_seed(overhead)
    lengths = torch.randint(1, 60, (9,), generator=generator).tolist()
    buckets = length_buckets(lengths, overhead)
    assert sorted(r for b in buckets for r in b) == list(range(9))
    cost = _padded(lengths, buckets) + overhead * len(buckets)
    # against every way of cutting the sorted rows into consecutive buckets
    order = sorted(range(9), key=lengths.__getitem__)
    best = min(_padded(lengths, parts) + overhead * len(parts) for cuts in range(2**8) for parts in [_cut(order, cuts)])
    assert cost == best
    if overhead == 0:
        assert _padded(lengths, buckets) == sum(lengths)


def _cut(order, cuts):
    parts, current = [], [order[0]]
    for i, r in enumerate(order[1:]):
        if cuts >> i & 1:
            parts.append(current)
            current = []
        current.append(r)
    return [*parts, current]
