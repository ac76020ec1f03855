"""Text in, titled passages out: the search tool the agent calls."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rljob.config import DataSpec
from rljob.data.hotpotqa import Passage, Question, build_corpus, load_questions_for_spec
from rljob.retrieval.bm25 import BM25Index, tokenize


def passage_tokens(passage: Passage) -> list[str]:
    """What BM25 indexes: the title and the text, so a title word can find its paragraph."""
    return tokenize(f"{passage.title} {passage.text}")


class Retriever:
    """BM25 over a fixed passage list; `search_batch` answers all of a turn's queries at once."""

    def __init__(self, passages: Sequence[Passage]):
        started = time.perf_counter()
        self.passages = list(passages)
        self.index = BM25Index([passage_tokens(p) for p in self.passages])
        self.build_seconds = time.perf_counter() - started

    @classmethod
    def from_questions(cls, questions: Sequence[Question]) -> Retriever:
        return cls(build_corpus(questions))

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        hits = self.index.search_batch([tokenize(q) for q in queries], k)
        return [[self.passages[h.doc] for h in row if h.score > 0.0] for row in hits]

    def search(self, query: str, k: int) -> list[Passage]:
        return self.search_batch([query], k)[0]


def build_retriever_for_spec(
    spec: DataSpec, extra_eval: Sequence[Question] = ()
) -> tuple[Retriever, list[Question], list[Question]]:
    """The job's retriever (corpus from train, or train+eval questions) and its questions.

    `extra_eval`: questions evaluated besides the job's eval set (`rljob eval --questions FILE`).
    Under ``train+eval`` their paragraphs join the corpus as the eval set's do, so the agent can
    find their evidence; under ``train`` they stay out, as the eval set's do.
    """
    train, evaluation = load_questions_for_spec(spec)
    return retriever_for(spec, train, [*evaluation, *extra_eval]), train, evaluation


def retriever_for(spec: DataSpec, train: Sequence[Question], evaluation: Sequence[Question]) -> Retriever:
    """The retriever over questions already loaded: train's paragraphs, and the evaluation's under
    ``corpusFrom: train+eval``."""
    return Retriever.from_questions([*train, *evaluation] if spec.corpus_from == "train+eval" else list(train))
