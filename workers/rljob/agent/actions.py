"""Parse a model turn into an action: a search, an answer, or nothing usable.

A turn ends at the first closing `</search>` or `</answer>` (the engines stop there). The action is
the content between that closing tag and the last matching opening tag before it, so text such as
"<answer> I think <answer> Paris </answer>" yields "Paris". Answers found in full texts
(`extract_answer`) use the last complete answer tag, as Search-R1's scorer does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_CLOSERS = {"search": "</search>", "answer": "</answer>"}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Action:
    kind: Literal["search", "answer", "invalid"]
    content: str = ""


def parse_action(turn_text: str) -> Action:
    """The first complete action of a turn; an empty query or answer is invalid."""
    closers = [(turn_text.find(tag), kind) for kind, tag in _CLOSERS.items() if tag in turn_text]
    if not closers:
        return Action("invalid")
    end, kind = min(closers)
    opener = f"<{kind}>"
    start = turn_text.rfind(opener, 0, end)
    if start < 0:
        return Action("invalid")
    content = " ".join(turn_text[start + len(opener) : end].split())
    return Action(kind, content) if content else Action("invalid")


def extract_answer(text: str) -> str | None:
    """The last complete <answer>...</answer> of a text (inner opening tags skipped), or None."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    last = matches[-1]
    last = last[last.rfind("<answer>") + len("<answer>") :] if "<answer>" in last else last
    return " ".join(last.split())
