"""Parse a model turn into an action: a search, an answer, or nothing usable.

A turn ends at the first closing `</search>` or `</answer>` (the engines stop there). The action is
the content between that closing tag and the last matching opening tag before it, so text such as
"<answer> I think <answer> Paris </answer>" yields "Paris".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_CLOSERS = {"search": "</search>", "answer": "</answer>"}


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
