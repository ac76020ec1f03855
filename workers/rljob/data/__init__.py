"""HotpotQA questions and the passage corpus built from their context paragraphs."""

from rljob.data.hotpotqa import Passage, Question, build_corpus, load_questions, load_questions_for_spec

__all__ = ["Passage", "Question", "build_corpus", "load_questions", "load_questions_for_spec"]
