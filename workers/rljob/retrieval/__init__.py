"""BM25 retrieval over the HotpotQA passage corpus."""

from rljob.retrieval.retriever import Retriever, build_retriever_for_spec

__all__ = ["Retriever", "build_retriever_for_spec"]
