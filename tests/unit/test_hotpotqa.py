"""HotpotQA loading (JSON Lines and the original JSON array) and the one-passage-per-title corpus."""

from __future__ import annotations

import json
import sys
import types

import pytest

from rljob.assets import hotpotqa_file
from rljob.config import DataSpec, RLJob
from rljob.data.hotpotqa import build_corpus, hub_location, load_questions, load_questions_for_spec, parse_question
from rljob.retrieval import build_retriever_for_spec
from rljob.warmup.sft import job_demonstrations

RECORD = {
    "_id": "q1",
    "question": " Who? ",
    "answer": "Ann",
    "type": "bridge",
    "level": "easy",
    "supporting_facts": [["A", 0]],
    "context": [["A", ["First sentence.", " Second one."]], ["B", ["Other."]]],
}


def test_jsonl_and_json_array_give_the_same_questions(tmp_path) -> None:
    other = {**RECORD, "_id": "q2", "context": [["B", ["Changed."]], ["C", ["Third."]]]}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in (RECORD, other)) + "\n\n")
    (tmp_path / "a.json").write_text(json.dumps([RECORD, other]))
    lines, array = load_questions(tmp_path / "a.jsonl"), load_questions(tmp_path / "a.json")
    assert lines == array and [q.id for q in lines] == ["q1", "q2"]
    assert lines[0].question == "Who?" and lines[0].answers == ["Ann"]
    assert lines[0].context[0].text == "First sentence. Second one."
    corpus = build_corpus(lines)
    assert [p.title for p in corpus] == ["A", "B", "C"] and corpus[1].text == "Other."  # first title wins
    assert load_questions(tmp_path / "a.jsonl", limit=1) == lines[:1]


def test_hub_layout_is_normalised() -> None:
    hub = {
        "id": "h",
        "question": "Q",
        "answer": "x",
        "context": {"title": ["T1", "T2"], "sentences": [["a ", "b"], ["c"]]},
    }
    q = parse_question(hub)
    assert q.id == "h" and [(p.title, p.text) for p in q.context] == [("T1", "a b"), ("T2", "c")]


def test_sample_files_and_spec_corpus() -> None:
    dev = load_questions(hotpotqa_file("dev.jsonl"))
    assert len(dev) == 300 and all(q.answers and q.context for q in dev)
    spec = DataSpec(
        train_path=str(hotpotqa_file("train.jsonl")),
        eval_path=str(hotpotqa_file("dev.jsonl")),
        max_train_questions=40,
        corpus_from="train",
    )
    train, evaluation = load_questions_for_spec(spec)
    assert len(train) == 40 and len(evaluation) == 300
    retriever, _, _ = build_retriever_for_spec(spec)
    assert len(retriever.passages) == len(build_corpus(train))
    gold = train[0].context[0]
    assert retriever.search(gold.title + " " + gold.text[:200], 3)[0] == gold


@pytest.mark.parametrize("corpus_from", ["train", "train+eval"])
def test_extra_eval_questions_join_the_corpus_as_the_eval_set_does(tmp_path, corpus_from: str) -> None:
    """`rljob eval --questions FILE`: under train+eval the file's paragraphs are searchable (its
    questions' evidence was missing from the corpus before); under train they stay held out."""
    spec = DataSpec(
        train_path=str(hotpotqa_file("train.jsonl")),
        eval_path=str(hotpotqa_file("dev.jsonl")),
        max_train_questions=20,
        corpus_from=corpus_from,
    )
    own = {**RECORD, "_id": "own", "context": [["Zyxwv Quokka", ["The quokka zyxwv lives on Rottnest."]]]}
    (tmp_path / "own.jsonl").write_text(json.dumps(own) + "\n")
    extra = load_questions(tmp_path / "own.jsonl")
    retriever, _, evaluation = build_retriever_for_spec(spec, extra_eval=extra)
    without, _, _ = build_retriever_for_spec(spec)
    hits = retriever.search("zyxwv quokka", 3)
    if corpus_from == "train+eval":
        assert hits and hits[0] == extra[0].context[0]
        assert len(retriever.passages) == len(without.passages) + 1
    else:
        assert extra[0].context[0] not in retriever.passages
        assert len(retriever.passages) == len(without.passages)
    assert len(evaluation) == 300  # the job's eval set is unchanged either way


@pytest.mark.parametrize(
    ("location", "default", "expected"),
    [
        ("hotpotqa/hotpot_qa:train", "validation", ("hotpotqa/hotpot_qa", "train")),
        ("hotpotqa/hotpot_qa:", "train", ("hotpotqa/hotpot_qa", "train")),
        (":validation", "train", ("hotpotqa/hotpot_qa", "validation")),
        ("train", "validation", ("hotpotqa/hotpot_qa", "train")),
        ("", "validation", ("hotpotqa/hotpot_qa", "validation")),
    ],
)
def test_hub_locations(location: str, default: str, expected: tuple[str, str]) -> None:
    assert hub_location(location, default) == expected


def test_hub_training_questions_never_default_to_the_eval_split(monkeypatch) -> None:
    """`trainPath: "name:"` (no split) trained on "validation", the eval split, while the warm-up
    read "train" for the same path. The hub cannot be reached here, so `datasets` is a recorder."""
    calls: list[tuple[str, str, str]] = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: calls.append((name, config, split)) or []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    spec = DataSpec(source="hub", train_path="hotpotqa/hotpot_qa:", eval_path="hotpotqa/hotpot_qa:")
    load_questions_for_spec(spec)
    assert [split for _, _, split in calls] == ["train", "validation"]
    calls.clear()
    job_demonstrations(RLJob(spec={"data": spec.model_dump(by_alias=True)}), None, None)
    assert [split for _, _, split in calls] == ["train"]
