"""BM25 retrieval over the HotpotQA passage corpus."""

from rljob.retrieval.bm25 import BM25Index, SearchHit, tokenize
from rljob.retrieval.retriever import Retriever, build_retriever_for_spec

__all__ = ["BM25Index", "Retriever", "SearchHit", "build_retriever_for_spec", "tokenize"]
