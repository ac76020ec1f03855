"""The BM25 index against rank-bm25's BM25Okapi, the reference."""

from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import build_corpus, load_questions
from rljob.retrieval.bm25 import BM25Index, tokenize
from rljob.retrieval.retriever import passage_tokens


def test_tokenize() -> None:
    assert tokenize("Émile's 2 CATS, über-fast!") == ["émile", "s", "2", "cats", "über", "fast"]


def test_scores_equal_reference_on_a_toy_corpus_with_negative_idf() -> None:
    docs = [["a", "b", "a"], ["a", "c"], ["a", "d", "d", "d"], [], ["b", "c", "e"]]
    ref = BM25Okapi(docs, k1=1.2, b=0.6, epsilon=0.3)
    ours = BM25Index(docs, k1=1.2, b=0.6, epsilon=0.3, dense_fraction=0.5)  # "a" goes the dense path
    queries = [["a"], ["a", "a", "d"], ["zzz"], [], ["e", "b", "c", "x"], ["d"]]
    got = ours.scores_batch(queries)
    for q, row in zip(queries, got, strict=True):
        np.testing.assert_allclose(row, ref.get_scores(q), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.scores_batch([["a"]])[0], ref.get_scores(["a"]))  # dense terms only
    assert ours.idf[ours.vocab["a"]] == pytest.approx(0.3 * ref.average_idf)  # the epsilon floor
    (hits,) = ours.search_batch([["d"]], 2)
    assert hits[0].doc == 2 and hits[0].score > 0


def test_top_k_matches_reference_on_dev_questions() -> None:
    corpus = build_corpus(load_questions(hotpotqa_file("train.jsonl"), limit=150))
    docs = [passage_tokens(p) for p in corpus]
    ref, ours = BM25Okapi(docs), BM25Index(docs)
    queries = [tokenize(q.question) for q in load_questions(hotpotqa_file("dev.jsonl"), limit=40)]
    k, agree = 5, 0
    for q, hits in zip(queries, ours.search_batch(queries, k), strict=True):
        ref_scores = ref.get_scores(q)
        ref_top = np.argsort(ref_scores)[::-1][:k]
        same_ids = [h.doc for h in hits] == list(ref_top)
        same_scores = np.allclose([h.score for h in hits], ref_scores[ref_top], rtol=1e-9)  # ties aside
        agree += same_ids or same_scores
    assert agree / len(queries) >= 0.99


def test_ties_at_the_cut_go_to_the_lowest_document_ids() -> None:
    # Many documents with the same score around the k-th place: the documented order is score,
    # then lower id; argpartition alone picked arbitrarily among the tied ones.
    rng = np.random.default_rng(3)
    for _ in range(50):
        docs = [
            list(rng.choice(["a", "b", "c", "d"], size=rng.integers(1, 4))) for _ in range(int(rng.integers(8, 60)))
        ]
        index = BM25Index(docs)
        for query in (["a"], ["b", "c"], ["d", "d"]):
            scores = index.scores_batch([query])[0]
            for k in (1, 3, 5):
                want = sorted(range(len(docs)), key=lambda i: (-scores[i], i))[:k]
                assert [h.doc for h in index.search_batch([query], k)[0]] == want
