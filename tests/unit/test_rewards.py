"""SQuAD-style normalisation, exact match, F1 and the trajectory reward on tricky answers."""

from __future__ import annotations

import pytest

from rljob.agent.rewards import exact_match, f1_score, normalize_answer, trajectory_reward
from rljob.config import AgentSpec


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Beatles", "beatles"),
        ("  an   Apple, a day! ", "apple day"),
        ("Théâtre de l'Odéon", "théâtre de lodéon"),
        ("ＰＡＲＩＳ", "paris"),  # full-width letters (NFKC)
        ("«Paris»—France", "parisfrance"),  # unicode punctuation dropped
        ("theatre", "theatre"),  # 'the' only as a word
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match_against_any_gold() -> None:
    assert exact_match("the Gold Coast.", ["Brisbane", "Gold Coast"]) == 1.0
    assert exact_match("Gold Coast, Queensland", ["Gold Coast"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert exact_match("", [""]) == 1.0
    assert exact_match("anything", []) == 0.0


def test_f1_partial_overlap_and_edge_cases() -> None:
    assert f1_score("Gold Coast Queensland", ["Gold Coast"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1_score("the", ["a"]) == 0.0  # both normalise to empty, but differ: see the test below
    assert f1_score("", ["Paris"]) == 0.0
    assert f1_score(None, ["Paris"]) == 0.0
    assert f1_score("no way", ["no"]) == 0.0  # HotpotQA: yes/no only score when identical
    assert f1_score("yes", ["yes"]) == 1.0
    assert f1_score("Paris", ["London", "paris!"]) == 1.0


@pytest.mark.parametrize("score", [exact_match, f1_score])
def test_a_gold_that_normalises_to_nothing_matches_only_itself(score) -> None:
    """HotpotQA has golds like "!!!": full normalisation empties them, and "the" or "?" too."""
    assert normalize_answer("!!!") == normalize_answer("the") == ""
    for answer in ("the", "?", "", "a", "!!", "!!!!"):
        assert score(answer, ["!!!"]) == 0.0, answer
    for answer in ("!!!", " !!! ", "!!!\n"):
        assert score(answer, ["!!!"]) == 1.0, answer
    assert score("The", ["the"]) == 1.0  # light normalisation still ignores case
    assert score("Paris", ["!!!", "Paris."]) == 1.0  # other golds keep full normalisation
    assert score("the", ["!!!", "Paris"]) == 0.0


def test_trajectory_reward_em_f1_and_bonuses() -> None:
    spec = AgentSpec(reward="em", format_reward=0.2, search_reward=0.1)
    assert trajectory_reward("Paris", ["paris"], True, 2, spec) == pytest.approx((1.3, 1.0, 1.0))
    assert trajectory_reward(None, ["paris"], False, 1, spec) == pytest.approx((0.1, 0.0, 0.0))
    f1_spec = AgentSpec(reward="f1")
    reward, em, f1 = trajectory_reward("Paris France", ["Paris"], True, 0, f1_spec)
    assert em == 0.0 and reward == f1 == pytest.approx(2 / 3)
