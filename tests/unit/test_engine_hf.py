"""The transformers engine on a tiny random Llama: cache reuse, batching, log-probs, stops."""

from __future__ import annotations

import pytest
import torch

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import load_questions
from rljob.engines import hf
from rljob.engines.base import TurnParams
from rljob.engines.hf import DRAW_BLOCK, HFEngine, draw_from, sample_tokens
from support.tiny_models import tiny_random_model, train_tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=100)
    texts = [q.question for q in questions] + [p.text for q in questions[:30] for p in q.context]
    tokenizer = train_tiny_tokenizer(texts, vocab_size=400)
    return tiny_random_model(tokenizer, seed=1), tokenizer


def _contexts(tokenizer) -> list[list[int]]:
    texts = ["Which city is the capital of France?", "Who wrote it", "The band was formed in 1990 by two brothers."]
    return [tokenizer.encode(t) for t in texts]


def _teacher_forced_logprobs(model, ids: list[int], start: int, temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(ids[1:])
    return logp.gather(-1, targets[:, None])[:, 0][start - 1 :].tolist()


def _two_turns(engine: HFEngine, contexts, params_for, inject):
    first = engine.generate(contexts, params_for(len(contexts)))
    nexts = [c + o.token_ids + inject for c, o in zip(contexts, first, strict=True)]
    keep = [0, 2]  # a finished sample drops out between turns
    second = engine.generate([nexts[i] for i in keep], params_for(len(keep)))
    return first, [nexts[i] for i in keep], second


def test_cache_reuse_matches_fresh_prefill(tiny):
    model, tokenizer = tiny
    inject = tokenizer.encode(" <information> Paris is the capital. </information> ")

    def params(n: int) -> TurnParams:
        return TurnParams(max_new_tokens=[7, 12, 5][:n] if n == 3 else [9, 4], greedy=True)

    reused = HFEngine(model, tokenizer, reuse_cache=True)
    fresh = HFEngine(model, tokenizer, reuse_cache=False)
    a1, a_ctx, a2 = _two_turns(reused, _contexts(tokenizer), params, inject)
    b1, _, b2 = _two_turns(fresh, _contexts(tokenizer), params, inject)
    assert reused.stats.reused_tokens > 0 and fresh.stats.reused_tokens == 0
    for x, y in zip(a1 + a2, b1 + b2, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    # and both equal a plain teacher-forced forward over the whole sequence
    for ctx, out in zip(a_ctx, a2, strict=True):
        expected = _teacher_forced_logprobs(model, ctx + out.token_ids, len(ctx), 1.0)
        assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_batched_greedy_equals_one_at_a_time(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    contexts = _contexts(tokenizer)
    budgets = [10, 6, 8]
    batched = engine.generate(contexts, TurnParams(max_new_tokens=budgets, greedy=True))
    for ctx, budget, out in zip(contexts, budgets, batched, strict=True):
        single = engine.generate([ctx], TurnParams(max_new_tokens=[budget], greedy=True))[0]
        assert single.token_ids == out.token_ids
        assert len(out.token_ids) <= budget


def test_sampled_logprobs_are_those_of_the_tempered_distribution(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer, seed=3)
    contexts = _contexts(tokenizer)
    outs = engine.generate(contexts, TurnParams(max_new_tokens=[12, 12, 12], temperature=0.7))
    for ctx, out in zip(contexts, outs, strict=True):
        expected = _teacher_forced_logprobs(model, ctx + out.token_ids, len(ctx), 0.7)
        assert out.logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp <= 0.0 for lp in out.logprobs)


def test_stop_string_ends_a_sample_at_the_token_completing_it(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer, seed=0)
    outs = engine.generate(_contexts(tokenizer) * 4, TurnParams(max_new_tokens=[40] * 12, stop=("e",)))
    assert any(o.finish_reason == "stop" for o in outs)
    for out in outs:
        if out.finish_reason == "stop":
            assert "e" in out.text and "e" not in tokenizer.decode(out.token_ids[:-1])
        else:
            assert "e" not in out.text and out.finish_reason in {"length", "eos"}


def test_two_level_draw_follows_the_categorical_and_never_picks_a_zero_weight_token():
    """Blocks of DRAW_BLOCK tokens, the last one partial: the empirical frequencies of 200k draws
    match the weights (every token within 5 standard errors) and zero-weight tokens never come up."""
    gen = torch.Generator().manual_seed(3)
    vocab = 2 * DRAW_BLOCK + 37
    weights = torch.rand((1, vocab), generator=gen) ** 4
    weights[0, ::7] = 0.0  # zeros inside blocks, at block edges and in the partial block
    weights[0, DRAW_BLOCK : 2 * DRAW_BLOCK] = 0.0  # a whole block without mass
    draws, _ = draw_from(weights.expand(200_000, vocab).contiguous(), gen)
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts.numel() == vocab and counts[weights[0] == 0].sum() == 0
    p = (weights[0] / weights[0].sum()).double()
    stderr = (p * (1 - p) / draws.numel()).sqrt()
    assert ((counts / draws.numel() - p).abs() <= 5 * stderr + 1e-12).all()


def test_sampled_logprobs_are_the_tempered_log_softmax_of_the_drawn_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn((64, 49_152), generator=gen) * 4).to(torch.bfloat16)
    for top_p in (1.0, 0.9):
        tokens, logprobs = sample_tokens(logits, TurnParams(max_new_tokens=[1] * 64, temperature=0.7, top_p=top_p), gen)
        reference = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, tokens[:, None])[:, 0]
        if top_p == 1.0:
            torch.testing.assert_close(logprobs, reference, atol=2e-5, rtol=0)
        else:  # renormalised over the nucleus: at least as likely as under the full distribution
            assert (logprobs >= reference - 2e-5).all() and torch.isfinite(logprobs).all()


def test_top_p_keeps_the_nucleus_and_renormalises():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = TurnParams(max_new_tokens=[1], temperature=1.0, top_p=0.7)
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_tokens(logits, params, gen)[0]) for _ in range(200)}
    probs = logits.softmax(-1)[0]
    assert probs[0] < 0.7 < probs[0] + probs[1] and seen == {0, 1}
    tok, lp = sample_tokens(logits, params, gen)
    nucleus = probs[:2] / probs[:2].sum()
    assert float(lp[0]) == pytest.approx(float(nucleus[int(tok[0])].log()), abs=1e-6)


def test_shared_prefill_and_set_aside_rows_change_no_token_or_logprob(tiny):
    """A question's G copies share one prefill, and rows that finish early are set aside and put
    back: over two turns every sample's tokens and log-probs equal a plain teacher-forced forward."""
    model, tokenizer = tiny
    contexts = [c for c in _contexts(tokenizer) for _ in range(4)]  # 3 questions x G=4
    budgets = [2, 3, 11, 16, 1, 5, 9, 14, 4, 4, 12, 7]  # rows end at different steps
    inject = tokenizer.encode(" <information> Paris is the capital. </information> ")
    engine = HFEngine(model, tokenizer, seed=5)
    first = engine.generate(contexts, TurnParams(max_new_tokens=budgets, temperature=0.9))
    assert engine.stats.shared_prefill_tokens == sum(len(c) for c in contexts) - sum(map(len, _contexts(tokenizer)))
    assert engine.stats.compactions >= 2
    assert engine.stats.decode_row_steps < len(contexts) * (max(budgets) - 1)
    nexts = [c + o.token_ids + inject for c, o in zip(contexts, first, strict=True)]
    second = engine.generate(nexts, TurnParams(max_new_tokens=budgets[::-1], temperature=0.9))
    cached = [len(c) + len(o.token_ids) - 1 for c, o in zip(contexts, first, strict=True)]
    assert engine.stats.reused_tokens == sum(cached)
    for ctx, out, budget in zip(contexts + nexts, first + second, budgets + budgets[::-1], strict=True):
        assert len(out.token_ids) == budget or out.finish_reason == "eos"
        expected = _teacher_forced_logprobs(model, ctx + out.token_ids, len(ctx), 0.9)
        assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_with_shared_prefill_equals_one_at_a_time(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    contexts = [c for c in _contexts(tokenizer) for _ in range(3)]
    budgets = [3, 9, 6, 12, 2, 8, 5, 5, 10]
    batched = engine.generate(contexts, TurnParams(max_new_tokens=budgets, greedy=True))
    for ctx, budget, out in zip(contexts, budgets, batched, strict=True):
        single = HFEngine(model, tokenizer).generate([ctx], TurnParams(max_new_tokens=[budget], greedy=True))[0]
        assert single.token_ids == out.token_ids
        assert single.logprobs == pytest.approx(out.logprobs, abs=1e-5)


def test_cpu_engine_decodes_with_matmul_attention(tiny):
    from rljob.engines.attention import ATTENTION_NAME

    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    assert engine.model.config._attn_implementation == ATTENTION_NAME


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
