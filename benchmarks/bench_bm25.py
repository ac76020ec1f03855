"""BM25: the project's index against rank-bm25's BM25Okapi on the train.jsonl corpus.

Agreement: top-k of both on dev questions (same tokenisation); a query agrees when the ids match
or the score lists match (a tie broken the other way). Speed: one batch of dev queries through
`search_batch` against rank-bm25's `get_scores` + argsort, per query. Index build time for both.
  python benchmarks/bench_bm25.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from _common import RESULTS, finish, progress
from rank_bm25 import BM25Okapi

from rljob.assets import hotpotqa_file
from rljob.data.hotpotqa import build_corpus, load_questions
from rljob.retrieval.bm25 import BM25Index, tokenize
from rljob.retrieval.retriever import passage_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="time rank-bm25 on 20 queries (under a minute)")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    corpus = build_corpus(load_questions(hotpotqa_file("train.jsonl")))
    dev = load_questions(hotpotqa_file("dev.jsonl"))
    started = time.perf_counter()
    docs = [passage_tokens(p) for p in corpus]
    tokenize_s = time.perf_counter() - started
    started = time.perf_counter()
    ours = BM25Index(docs)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    ref = BM25Okapi(docs)
    ref_build_s = time.perf_counter() - started
    progress(
        f"corpus {len(corpus)} passages; tokenise {tokenize_s:.2f}s, build ours {build_s:.2f}s, "
        f"rank-bm25 {ref_build_s:.2f}s"
    )

    queries = [tokenize(q.question) for q in dev]
    best_ours = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        hits = ours.search_batch(queries, args.k)
        best_ours = min(best_ours, time.perf_counter() - started)
    ours_per_query = best_ours / len(queries)
    progress(f"ours: {len(queries)} queries in {best_ours * 1e3:.1f} ms ({ours_per_query * 1e3:.3f} ms/query)")

    n_ref = 20 if args.quick else len(queries)
    agree, ref_seconds = 0, 0.0
    for i, (q, row) in enumerate(zip(queries[:n_ref], hits, strict=False)):
        started = time.perf_counter()
        scores = ref.get_scores(q)
        top = np.argsort(scores)[::-1][: args.k]
        ref_seconds += time.perf_counter() - started
        same_ids = [h.doc for h in row] == list(top)
        agree += same_ids or np.allclose([h.score for h in row], scores[top], rtol=1e-9)
        if (i + 1) % 50 == 0:
            progress(f"rank-bm25: {i + 1}/{n_ref} queries")
    ref_per_query = ref_seconds / n_ref
    summary = {
        "benchmark": "bm25",
        "quick": args.quick,
        "passages": len(corpus),
        "k": args.k,
        "queries_compared": n_ref,
        "topk_agreement": agree / n_ref,
        "ours_ms_per_query": ours_per_query * 1e3,
        "rank_bm25_ms_per_query": ref_per_query * 1e3,
        "speedup": ref_per_query / ours_per_query,
        "ours_build_s": build_s,
        "rank_bm25_build_s": ref_build_s,
        "tokenise_s": tokenize_s,
    }
    progress(f"{'':14}{'ours':>12}{'rank-bm25':>12}{'ratio':>10}")
    progress(f"{'ms/query':14}{ours_per_query * 1e3:12.3f}{ref_per_query * 1e3:12.2f}{summary['speedup']:10.1f}")
    progress(f"{'build s':14}{build_s:12.2f}{ref_build_s:12.2f}{ref_build_s / build_s:10.1f}")
    progress(f"top-{args.k} agreement: {agree}/{n_ref}")
    _plot(summary)
    finish("bm25", summary)


def _plot(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["rank-bm25", "rljob BM25Index"], [summary["rank_bm25_ms_per_query"], summary["ours_ms_per_query"]])
    ax.set_yscale("log")
    ax.set_ylabel("ms per query (log)")
    ax.set_title(f"BM25 over {summary['passages']} passages: {summary['speedup']:.0f}x faster")
    fig.tight_layout()
    fig.savefig(RESULTS / "bm25.png", dpi=100)


if __name__ == "__main__":
    main()
