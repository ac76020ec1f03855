"""Answer scoring: SQuAD-style normalisation, exact match, token F1, and the trajectory reward.

Normalisation follows the SQuAD / HotpotQA evaluation scripts (lower-case, drop punctuation, drop
the articles a/an/the, collapse white space) with two additions for text a model writes: unicode is
NFKC-normalised first (full-width letters, ligatures), and every unicode punctuation character is
dropped, not only ASCII's. F1 keeps HotpotQA's rule that yes/no answers score only when identical.
A gold answer that normalises to nothing (e.g. "!!!") is compared after case and white space
normalisation only, so that an empty-after-normalisation answer ("the", "?") does not match it.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

from rljob.config import AgentSpec

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCT = set(string.punctuation)
_YES_NO = {"yes", "no", "noanswer"}


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text if not _is_punct(ch))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _light_normalize(text: str) -> str:
    """Case and white space only: how a gold that `normalize_answer` empties is still compared."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def _best_score(prediction: str | None, golds: Sequence[str], score: Callable[[str, str], float]) -> float:
    """The best `score(normalised prediction, normalised gold)` over the golds (a gold that normalises
    to nothing: light normalisation, see the module docstring); None scores 0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in golds:
        norm = normalize_answer(gold)
        value = score(pred, norm) if norm else float(_light_normalize(prediction) == _light_normalize(gold))
        best = max(best, value)
    return best


def exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer; None scores 0."""
    return _best_score(prediction, golds, lambda pred, gold: float(pred == gold))


def _f1(pred: str, gold: str) -> float:
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golds: Sequence[str]) -> float:
    """Best token-overlap F1 over the gold answers; None scores 0."""
    return _best_score(prediction, golds, _f1)


def trajectory_reward(
    answer: str | None, golds: Sequence[str], format_ok: bool, num_searches: int, spec: AgentSpec
) -> tuple[float, float, float]:
    """(reward, exact_match, f1): the main score (EM or F1) plus the optional format/search bonuses.

    The bonuses are small additive shaping terms; an unanswered trajectory gets only the search
    bonus, so answering (correctly) always beats not answering when format_reward > 0.
    """
    em, f1 = exact_match(answer, golds), f1_score(answer, golds)
    reward = em if spec.reward == "em" else f1
    if format_ok:
        reward += spec.format_reward
    if num_searches > 0:
        reward += spec.search_reward
    return reward, em, f1
