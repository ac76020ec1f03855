"""Protocol demonstrations built from training questions only, token for token as RL sees them.

A demonstration is what a good rollout would look like: the prompt of `agent.prompt`, a short
<think>, a <search> whose query is the question itself, the real BM25 <information> block the
project's retriever returns for it, optionally a second search for a supporting paragraph's title
that the first search missed (bridge questions), then <answer>gold</answer>. Model-written turns
and injected text are tokenised separately and concatenated, exactly as `agent.rollout` builds a
trajectory, so the loss mask is the RL loss mask. Only questions whose gold answer appears in the
retrieved text (or yes/no questions) are kept: the model should learn to copy from evidence, not
to recite answers it could not have found.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob.agent.prompt import information_block, prompt_ids, trim_words
from rljob.agent.rewards import normalize_answer
from rljob.config import AgentSpec
from rljob.data.hotpotqa import Passage, parse_question


@dataclass
class Demonstration:
    """One teacher-forced trajectory: ids, and 1 where the model writes the token (the loss)."""

    question_id: str
    token_ids: list[int]
    loss_mask: list[int]
    searches: list[str] = field(default_factory=list)
    answer: str = ""

    def add(self, ids: list[int], written: bool) -> None:
        self.token_ids += ids
        self.loss_mask += [int(written)] * len(ids)


def supporting_titles(record: Mapping[str, Any]) -> list[str]:
    """Titles of the gold supporting paragraphs, in order, without repeats (file or hub layout)."""
    facts = record.get("supporting_facts") or []
    titles = facts.get("title", []) if isinstance(facts, Mapping) else [f[0] for f in facts]
    return list(dict.fromkeys(str(t) for t in titles))


def answer_found(answer: str, passages: Sequence[Passage], max_words: int) -> bool:
    """Yes/no answers need no span; any other answer must appear in what the model was shown of one
    passage (its title and trimmed text): not in the "Doc i (Title: ...)" wrapper, whose words
    made golds like "1" or "title" always found, and not across two passages."""
    gold = normalize_answer(answer)
    if gold in {"yes", "no"}:
        return True
    return bool(gold) and any(
        f" {gold} " in f" {normalize_answer(f'{p.title} {trim_words(p.text, max_words)}')} " for p in passages
    )


def demonstration_for(
    record: Mapping[str, Any], tokenizer: Any, retriever: Any, spec: AgentSpec, max_searches: int = 2
) -> Demonstration | None:
    """The demonstration for one training record, or None when its answer is not retrievable."""
    question = parse_question(record)
    if not question.answers or not question.answers[0].strip():
        return None
    gold = question.answers[0].strip()
    # A search needs a turn after it for the answer: with one turn, RL can only answer at once, so a
    # demonstration must too (only answers needing no passage, yes/no, remain).
    max_searches = max(0, min(max_searches, spec.max_turns - 1))
    ids = prompt_ids(tokenizer, question.question)
    demo = Demonstration(question.id, list(ids), [0] * len(ids), answer=gold)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def write(text: str) -> bool:
        """Add a model turn; False when it exceeds the turn budget RL generation has."""
        turn = encode(text)
        demo.add(turn, written=True)
        return len(turn) <= spec.max_new_tokens_per_turn

    query, thought = question.question, "I need to search for this."
    shown: list[Passage] = []
    missing = supporting_titles(record)
    for _ in range(max_searches):
        if not write(f"<think> {thought} </think>\n<search> {query} </search>"):
            return None
        demo.searches.append(query)
        passages = retriever.search(query, spec.top_k)
        shown += passages
        demo.add(encode(information_block(passages, spec.passage_max_words)), written=False)
        found = {p.title for p in shown}
        missing = [t for t in missing if t not in found]
        if not missing or answer_found(gold, shown, spec.passage_max_words):
            break
        query, thought = missing[0], f"I also need {missing[0]}."
    if not answer_found(gold, shown, spec.passage_max_words):
        return None
    if not write(f"<think> The documents give the answer. </think>\n<answer> {gold} </answer>"):
        return None
    if len(demo.token_ids) > spec.max_total_tokens:
        return None  # RL could never have produced it under the job's budget
    return demo


def build_demonstrations(
    records: Sequence[Mapping[str, Any]] | Iterator[Mapping[str, Any]],
    tokenizer: Any,
    retriever: Any,
    spec: AgentSpec,
    *,
    limit: int,
    max_searches: int = 2,
) -> tuple[list[Demonstration], int]:
    """Up to `limit` demonstrations from `records` in order; also returns how many records were read."""
    demos: list[Demonstration] = []
    read = 0
    for record in records:
        if len(demos) >= limit:
            break
        read += 1
        demo = demonstration_for(record, tokenizer, retriever, spec, max_searches)
        if demo is not None:
            demos.append(demo)
    return demos, read
