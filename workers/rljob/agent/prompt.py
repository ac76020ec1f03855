"""The agent's instructions and the text injected between turns, in the project's own words."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rljob.data.hotpotqa import Passage

INSTRUCTIONS = (
    "You answer questions that may need facts from several documents. You have a search engine.\n"
    "Think step by step inside <think> and </think>. To look something up, write a short query "
    "inside <search> and </search>, then stop; the top results will be shown to you inside "
    "<information> and </information>. Search as often as you need. When you are sure, write only "
    "the final answer, as few words as possible, inside <answer> and </answer>, "
    "for example <answer> Marie Curie </answer>.\n"
)

INVALID_ACTION = (
    "\n<information>That was not a valid step. Write a query inside <search> and </search> to search, "
    "or the final answer inside <answer> and </answer>.</information>\n"
)

STOP_STRINGS = ("</search>", "</answer>")


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The first tokens of a trajectory: the chat template's user turn when the tokenizer has one."""
    message = f"{INSTRUCTIONS}\nQuestion: {question.strip()}\n"
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(message + "\nAssistant:", add_special_tokens=True)


def trim_words(text: str, max_words: int) -> str:
    words = text.split()
    return " ".join(words[:max_words]) + (" ..." if len(words) > max_words else "")


def information_block(passages: Sequence[Passage], max_words: int) -> str:
    """Retrieved passages as injected text; each keeps its title so the model can cite and hop."""
    if not passages:
        body = "No results."
    else:
        body = "\n".join(
            f"Doc {i} (Title: {p.title}) {trim_words(p.text, max_words)}" for i, p in enumerate(passages, 1)
        )
    return f"\n\n<information>\n{body}\n</information>\n\n"
