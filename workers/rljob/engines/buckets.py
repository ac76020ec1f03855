"""Which rows of a prefill go in one forward: rows of very unequal chunk lengths go apart.

A batched forward pads every row to its longest chunk. In a multi-turn rollout the chunks of one
turn are the observations appended to each sample, and their lengths differ by several times (a
short correction beside a retrieved passage block), so one forward can compute mostly padding.
"""

from __future__ import annotations

from collections.abc import Sequence


def length_buckets(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """A partition of the rows into buckets of similar length, each fed by its own forward.

    Minimises the positions computed (a bucket's rows times its longest length) plus `overhead`
    positions for each forward, the fixed cost of a forward and of merging its cache back, by
    dynamic programming over the rows sorted by length (a best partition of that kind keeps them
    sorted). Buckets come shortest first, each listing row indices shortest first.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cost = [0] * (len(order) + 1)
    start = [0] * (len(order) + 1)  # where the last bucket of the best cover of order[:i] starts
    for end in range(1, len(order) + 1):
        width = lengths[order[end - 1]]
        cost[end], start[end] = min((cost[j] + (end - j) * width + overhead, j) for j in range(end))
    buckets, end = [], len(order)
    while end:
        buckets.append(order[start[end] : end])
        end = start[end]
    return buckets[::-1]
