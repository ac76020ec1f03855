"""Length buckets for the engine's prefill: fewer padded positions, same log-probs."""

from __future__ import annotations

import pytest
import torch

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import load_questions
from rljob.engines import hf
from rljob.engines.base import TurnParams
from rljob.engines.buckets import length_buckets
from rljob.engines.hf import HFEngine
from support.tiny_models import tiny_random_model, train_tiny_tokenizer

torch.set_num_threads(1)


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


@pytest.fixture(scope="module")
def tiny():
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=100)
    texts = [q.question for q in questions] + [p.text for q in questions[:30] for p in q.context]
    tokenizer = train_tiny_tokenizer(texts, vocab_size=400)
    return tiny_random_model(tokenizer, seed=1), tokenizer


def _teacher_forced_logprobs(model, ids: list[int], start: int, temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0][start - 1 :].tolist()


def test_bucketed_prefill_changes_no_logprob_and_saves_the_padding(tiny, monkeypatch):
    """Turn two appends a short correction to most samples and a long block to one: the long one
    gets its own forward, and every sample's tokens and log-probs over both turns, and a third
    turn on the merged cache, equal a plain teacher-forced forward."""
    model, tokenizer = tiny
    monkeypatch.setattr(hf, "BUCKET_OVERHEAD", 8)
    questions = ["Which city is the capital of France?", "Who wrote it", "The band was formed in 1990."]
    contexts = [tokenizer.encode(q) for q in questions for _ in range(3)]
    short = tokenizer.encode(" Invalid. ")
    long = tokenizer.encode(" <information> Paris is the capital and largest city of France. </information> ") * 2
    engine = HFEngine(model, tokenizer, seed=7)
    contexts_by_turn, outs_by_turn = [], []
    for turn in range(3):
        forwards, padded = engine.stats.prefill_forwards, engine.stats.padded_prefill_positions
        budgets = [4 + (i + turn) % 5 for i in range(len(contexts))]
        outs = engine.generate(contexts, TurnParams(max_new_tokens=budgets, temperature=0.9))
        contexts_by_turn.append(contexts)
        outs_by_turn.append(outs)
        contexts = [
            c + o.token_ids + (long if i == 4 else short) for i, (c, o) in enumerate(zip(contexts, outs, strict=True))
        ]
        if turn == 1:  # the short suffixes in one forward, the long one in another: no padding
            assert engine.stats.prefill_forwards - forwards == 2
            assert engine.stats.padded_prefill_positions == padded
    for contexts, outs in zip(contexts_by_turn, outs_by_turn, strict=True):
        for ctx, out in zip(contexts, outs, strict=True):
            expected = _teacher_forced_logprobs(model, ctx + out.token_ids, len(ctx), 0.9)
            assert out.logprobs == pytest.approx(expected, abs=1e-4)
