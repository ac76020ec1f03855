"""Warm-up, validation and RL question pools never share a question, in any epoch or after a resume."""

from __future__ import annotations

import pytest

from rljob.assets import hotpotqa_file
from rljob.config import RLJob
from rljob.data.pools import job_pools, split_pools, warmup_pool_size
from rljob.trainer.prompts import load_questions, step_requests


def test_split_is_disjoint_deterministic_and_leaves_out_eval_ids() -> None:
    ids = [f"q{i}" for i in range(100)] + ["q5", "q7"]  # two duplicates
    pools = split_pools(ids, {"q3", "q4"}, warmup=20, validation=10, seed=3)
    parts = [set(pools.warmup), set(pools.validation), set(pools.rl)]
    assert [len(p) for p in parts] == [20, 10, 68] and pools.held_out_as_eval == 2
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    chosen = {ids[i] for p in parts for i in p}
    assert len(chosen) == 98 and not chosen & {"q3", "q4"}
    assert split_pools(ids, {"q3", "q4"}, warmup=20, validation=10, seed=3) == pools
    assert split_pools(ids, {"q3", "q4"}, warmup=20, validation=10, seed=4) != pools
    with pytest.raises(ValueError, match="leaving none for RL"):
        split_pools(ids, (), warmup=60, validation=40, seed=0)


def _job(**spec) -> RLJob:
    base = {
        "model": {"name": "unused"},
        "data": {
            "trainPath": str(hotpotqa_file("train.jsonl")),
            "evalPath": str(hotpotqa_file("dev.jsonl")),
            "validationQuestions": 200,
        },
        "warmup": {"enabled": True, "examples": 48},
        "grpo": {"questionsPerStep": 8, "groupSize": 2},
    }
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value}
    return RLJob.model_validate({"metadata": {"name": "pools", "namespace": "t"}, "spec": base})


def test_default_warmup_pool_is_twice_the_examples_and_at_most_half() -> None:
    assert warmup_pool_size(_job().spec, 2005) == 96
    assert warmup_pool_size(_job(warmup={"examples": 5000}).spec, 2005) == (2005 - 200) // 2
    assert warmup_pool_size(_job(warmup={"questionPool": 300}).spec, 2005) == 300
    assert warmup_pool_size(_job(warmup={"enabled": False}).spec, 2005) == 0


def test_rl_prompts_of_every_epoch_avoid_the_warmup_validation_and_eval_questions() -> None:
    from rljob.data import load_questions_for_spec

    job = _job()
    train, evaluation = load_questions_for_spec(job.spec.data)
    pools = job_pools(job.spec, [q.id for q in train], [q.id for q in evaluation])
    assert pools.sizes() == {"warmup": 96, "validation": 200, "rl": 2005 - 296, "dropped_eval_overlap": 0}
    rl_questions, eval_questions = load_questions(job)
    assert [q.id for q in rl_questions] == [train[i].id for i in pools.rl]
    forbidden = {train[i].id for i in pools.warmup + pools.validation} | {q.id for q in eval_questions}
    per_epoch = len(rl_questions) // 8 + 1
    asked = [r.question_id for step in range(3 * per_epoch) for r in step_requests(step, rl_questions, job, 0)]
    assert set(asked) == {q.id for q in rl_questions} and not set(asked) & forbidden
    # A resumed trainer loads the pools afresh and asks exactly what an uninterrupted one would.
    again, _ = load_questions(job)
    for step in (0, per_epoch - 1, per_epoch, 2 * per_epoch + 3):
        assert [r.question_id for r in step_requests(step, again, job, 0)] == [
            r.question_id for r in step_requests(step, rl_questions, job, 0)
        ]


def test_training_questions_also_in_the_eval_file_are_in_no_pool(tmp_path) -> None:
    dev = hotpotqa_file("dev.jsonl")
    job = _job(data={"trainPath": str(dev), "evalPath": str(dev), "validationQuestions": 0}, warmup={"enabled": False})
    with pytest.raises(ValueError, match="leaving none for RL"):
        load_questions(job)


def test_evaluations_can_score_the_validation_slice_instead_of_the_eval_set() -> None:
    from rljob.data import load_questions_for_spec

    job = _job(eval={"split": "validation", "questions": 50})
    train, evaluation = load_questions_for_spec(job.spec.data)
    pools = job_pools(job.spec, [q.id for q in train], [q.id for q in evaluation])
    rl_questions, scored = load_questions(job)
    assert [q.id for q in scored] == [train[i].id for i in pools.validation]
    assert not {q.id for q in scored} & ({q.id for q in rl_questions} | {q.id for q in evaluation})
    assert [q.id for q in load_questions(_job())[1]] == [q.id for q in evaluation]
    with pytest.raises(ValueError, match=r"set data\.validationQuestions"):
        _job(data={"validationQuestions": 0}, eval={"split": "validation"})


def test_max_questions_keeps_the_first_answerable_rl_questions_and_revisits_them_each_epoch() -> None:
    whole, _ = load_questions(_job(grpo={"answerableOnly": True}))
    job = _job(grpo={"answerableOnly": True, "maxQuestions": 12, "questionsPerStep": 6})
    small, _ = load_questions(job)
    assert [q.id for q in small] == [q.id for q in whole[:12]]
    epochs = [{r.question_id for s in (2 * e, 2 * e + 1) for r in step_requests(s, small, job, 0)} for e in range(4)]
    assert all(asked == {q.id for q in small} for asked in epochs)
    assert len(load_questions(_job(grpo={"maxQuestions": 10_000}))[0]) == 2005 - 296
