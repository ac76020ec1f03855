"""Load HotpotQA in its original layout and turn its context paragraphs into a retrieval corpus.

The original files are one JSON array (`hotpot_dev_distractor_v1.json`); the project's sample is
JSON Lines, gzip-compressed inside the package (plain or gzip, both are read). Both hold objects
with `_id`, `question`, `answer` and `context` (`[[title, [sentence, ...]], ...]`). The hub layout
(`hotpot_qa`, config `distractor`) stores the context as `{"title": [...], "sentences": [[...], ...]}`;
it is normalised to the same shape.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.config import DataSpec
from rljob.data.files import open_text


@dataclass(frozen=True)
class Passage:
    """One retrievable paragraph: its Wikipedia title and its text (sentences joined)."""

    title: str
    text: str


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: list[str]
    context: list[Passage] = field(default_factory=list)


def _context_passages(raw: Any) -> list[Passage]:
    if isinstance(raw, Mapping):  # hub layout: parallel lists
        pairs: Iterable[tuple[Any, Any]] = zip(raw.get("title", []), raw.get("sentences", []), strict=False)
    else:
        pairs = ((item[0], item[1]) for item in raw or [])
    passages = []
    for title, sentences in pairs:
        text = "".join(sentences) if isinstance(sentences, list) else str(sentences)
        passages.append(Passage(title=str(title), text=text.strip()))
    return passages


def parse_question(record: Mapping[str, Any]) -> Question:
    """One HotpotQA record (file or hub layout) as a Question; the gold answer may be a list."""
    answer = record.get("answer", record.get("answers", []))
    answers = [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]
    return Question(
        id=str(record.get("_id", record.get("id", ""))),
        question=str(record["question"]).strip(),
        answers=answers,
        context=_context_passages(record.get("context")),
    )


def load_records(path: str | Path, limit: int | None = None) -> Iterator[Mapping[str, Any]]:
    """Raw records of a HotpotQA JSON (array) or JSON Lines file, plain or gzip, in file order (the
    warm-up reads fields a Question drops, such as `supporting_facts`)."""
    with open_text(path) as fh:
        first = ""
        while not first:
            ch = fh.read(1)
            if not ch:
                return
            first = ch.strip()
        fh.seek(0)
        # The original release is one JSON array; the project's sample is JSON Lines.
        records = json.load(fh) if first == "[" else (json.loads(line) for line in fh if line.strip())
        yield from itertools.islice(records, limit)


def load_questions(path: str | Path, limit: int | None = None) -> list[Question]:
    """Questions from a HotpotQA JSON (array) or JSON Lines file, plain or gzip, in file order."""
    return [parse_question(record) for record in load_records(path, limit)]


HUB_DATASET = "hotpotqa/hotpot_qa"


def hub_location(location: str, default_split: str) -> tuple[str, str]:
    """(dataset, split) of a hub path: `name:split`, `:split`, `name:` or `split`; the split a role's
    own default where none is given ("train" for training questions, "validation" for eval), so an
    empty split never trains on the evaluation split."""
    name, _, split = location.rpartition(":")
    return name or HUB_DATASET, split or default_split


def load_hub_records(name: str, split: str, limit: int | None = None) -> list[Mapping[str, Any]]:
    """The raw records of a HotpotQA `distractor` split on the hub (`datasets`: only where a cluster can reach it)."""
    import datasets  # the `hub` extra (both worker images install it); not needed for local files

    dataset = datasets.load_dataset(name, "distractor", split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return list(dataset)


def job_records(source: str, location: str, limit: int | None, default_split: str) -> Iterable[Mapping[str, Any]]:
    """The raw records at one of a job's data locations: a hub split (`hub_location`) or a file."""
    if source == "hub":
        return load_hub_records(*hub_location(location, default_split), limit)
    return load_records(location, limit)


def load_questions_for_spec(spec: DataSpec) -> tuple[list[Question], list[Question]]:
    """The (train, eval) questions a job uses; train is limited to `max_train_questions`."""
    train = job_records(spec.source, spec.train_path, spec.max_train_questions, "train")
    evaluation = job_records(spec.source, spec.eval_path, None, "validation")
    return [parse_question(r) for r in train], [parse_question(r) for r in evaluation]


def build_corpus(questions: Iterable[Question]) -> list[Passage]:
    """One passage per distinct title, first occurrence wins, in order of appearance."""
    seen: dict[str, Passage] = {}
    for question in questions:
        for passage in question.context:
            if passage.title not in seen:
                seen[passage.title] = passage
    return list(seen.values())
