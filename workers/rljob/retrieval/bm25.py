"""BM25 with rank-bm25's `BM25Okapi` semantics, scored as a sparse matrix product.

rank-bm25 loops over every document for every query term in Python. Here the BM25 weight of each
(term, document) pair is computed once at build time and stored in a term-major CSR matrix, so a
query's scores are a weighted sum of the posting rows of its terms. A batch of queries is scored in
one vectorised pass: the postings of all (query, term) pairs are gathered and summed with
`np.bincount` into a dense (queries x documents) block, then `argpartition` picks the top k.
The few very common terms (in more than `dense_fraction` of documents: "the", "of", "which", ...)
hold most postings; their rows are also kept dense, and their part of the scores is one BLAS
matrix product (query term counts x dense rows) instead of a scatter of ~15k postings each.

Semantics kept from `BM25Okapi` (k1, b, epsilon): idf = ln(N - df + 0.5) - ln(df + 0.5); terms
with a negative idf get epsilon * (mean idf over the vocabulary); a repeated query term counts once
per occurrence; unknown terms add nothing. Scores are float64 like rank-bm25's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_TOKEN = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word characters (unicode aware); the same function feeds rank-bm25 in tests."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class SearchHit:
    doc: int
    score: float


class BM25Index:
    """An immutable BM25Okapi index; `search_batch` is the fast path."""

    def __init__(
        self,
        documents: Sequence[Sequence[str]],
        k1: float = 1.5,
        b: float = 0.75,
        epsilon: float = 0.25,
        dense_fraction: float = 0.125,
    ) -> None:
        self.k1, self.b, self.epsilon = k1, b, epsilon
        self.num_docs = len(documents)
        if self.num_docs == 0:
            raise ValueError("BM25 needs at least one document")
        vocab: dict[str, int] = {}
        term_ids: list[int] = []
        doc_lengths = np.empty(self.num_docs, dtype=np.int64)
        for d, tokens in enumerate(documents):
            doc_lengths[d] = len(tokens)
            term_ids.extend(vocab.setdefault(t, len(vocab)) for t in tokens)
        self.vocab = vocab
        num_terms = len(vocab)
        terms = np.asarray(term_ids, dtype=np.int64)
        docs = np.repeat(np.arange(self.num_docs, dtype=np.int64), doc_lengths)
        # Unique (term, doc) pairs with their counts, sorted term-major: the CSR layout.
        pair_keys, tf = np.unique(terms * self.num_docs + docs, return_counts=True)
        post_terms, post_docs = np.divmod(pair_keys, self.num_docs)
        df = np.bincount(post_terms, minlength=num_terms)

        idf = np.log(self.num_docs - df + 0.5) - np.log(df + 0.5)
        self.average_idf = float(idf.mean()) if num_terms else 0.0
        idf[idf < 0] = self.epsilon * self.average_idf
        self.idf = idf
        self.avgdl = float(doc_lengths.sum()) / self.num_docs
        norm = self.k1 * (1 - self.b + self.b * doc_lengths / self.avgdl)
        tf = tf.astype(np.float64)
        self.weights = idf[post_terms] * (tf * (self.k1 + 1)) / (tf + norm[post_docs])
        self.doc_ids = post_docs
        self.indptr = np.zeros(num_terms + 1, dtype=np.int64)
        np.cumsum(df, out=self.indptr[1:])
        dense = np.flatnonzero(df > dense_fraction * self.num_docs)
        self.dense_slot = np.full(num_terms, -1, dtype=np.int64)
        self.dense_slot[dense] = np.arange(len(dense))
        self.dense_rows = np.zeros((len(dense), self.num_docs))
        for slot, term in enumerate(dense):
            lo, hi = self.indptr[term], self.indptr[term + 1]
            self.dense_rows[slot, self.doc_ids[lo:hi]] = self.weights[lo:hi]

    def _query_terms(self, tokens: Sequence[str]) -> np.ndarray:
        ids = [self.vocab[t] for t in tokens if t in self.vocab]
        return np.asarray(ids, dtype=np.int64)

    def scores_batch(self, queries: Sequence[Sequence[str]]) -> np.ndarray:
        """Dense (len(queries) x num_docs) float64 scores, identical in meaning to get_scores."""
        nq = len(queries)
        per_query = [self._query_terms(q) for q in queries]
        rows = np.repeat(np.arange(nq, dtype=np.int64), [len(t) for t in per_query])
        terms = np.concatenate(per_query) if nq else np.empty(0, dtype=np.int64)
        slots = self.dense_slot[terms]
        is_dense = slots >= 0
        counts = np.zeros((nq, len(self.dense_rows)))
        np.add.at(counts, (rows[is_dense], slots[is_dense]), 1.0)
        rows, terms = rows[~is_dense], terms[~is_dense]
        starts, ends = self.indptr[terms], self.indptr[terms + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        # Positions of every posting of every (query, term) pair, without a Python loop.
        offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
        flat = np.repeat(rows * self.num_docs, lengths) + self.doc_ids[offsets]
        scores = np.bincount(flat, weights=self.weights[offsets], minlength=nq * self.num_docs)
        scores = scores.astype(np.float64, copy=False).reshape(nq, self.num_docs)  # int64 when empty
        if is_dense.any():
            scores += counts @ self.dense_rows
        return scores

    def search_batch(self, queries: Sequence[Sequence[str]], k: int, chunk: int = 64) -> list[list[SearchHit]]:
        """Top-k documents of each tokenised query, best first (ties: lower document id first)."""
        k = min(k, self.num_docs)
        out: list[list[SearchHit]] = []
        for start in range(0, len(queries), chunk):
            scores = self.scores_batch(queries[start : start + chunk])
            if k < self.num_docs:
                top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
                _lowest_ids_on_ties(scores, top)
            else:
                top = np.tile(np.arange(self.num_docs), (len(scores), 1))
            top_scores = np.take_along_axis(scores, top, axis=1)
            order = np.lexsort((top, -top_scores), axis=1)
            top = np.take_along_axis(top, order, axis=1)
            top_scores = np.take_along_axis(top_scores, order, axis=1)
            out.extend(
                [SearchHit(int(d), float(s)) for d, s in zip(row_d, row_s, strict=True)]
                for row_d, row_s in zip(top, top_scores, strict=True)
            )
        return out


def _lowest_ids_on_ties(scores: np.ndarray, top: np.ndarray) -> None:
    """Make each row of `top` (some k best ids per row of `scores`, from argpartition) the k best
    with ties at the cut going to the lowest ids, in place. argpartition picks arbitrarily among
    documents tied with the k-th score; such rows are rare, so they are redone one by one."""
    k = top.shape[1]
    top_scores = np.take_along_axis(scores, top, axis=1)
    kth = top_scores.min(axis=1, keepdims=True)
    tied_in_top = (top_scores == kth).sum(axis=1)
    tied_overall = (scores == kth).sum(axis=1)
    for row in np.flatnonzero(tied_overall > tied_in_top):
        above = np.flatnonzero(scores[row] > kth[row, 0])
        tied = np.flatnonzero(scores[row] == kth[row, 0])  # ascending ids
        top[row] = np.concatenate((above, tied[: k - above.size]))
