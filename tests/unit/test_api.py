"""Validation of good and bad RLJob specs by the pydantic model (the CRD mirrors these rules)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rljob.config import RLJob, RLJobSpec, load_rljob

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["rljob-tiny.yaml", "rljob-search-r1.yaml"])
def test_examples_validate(example: str) -> None:
    job = load_rljob(str(ROOT / "examples" / example))
    assert job.spec.trainer.replicas >= 1


def test_search_r1_example_gpu_budget() -> None:
    spec = load_rljob(str(ROOT / "examples" / "rljob-search-r1.yaml")).spec
    assert spec.model.name == "Qwen/Qwen2.5-3B-Instruct"
    assert spec.rollout.max_replicas * spec.rollout.resources.gpus == 14
    assert spec.trainer.replicas * spec.trainer.resources.gpus == 2


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"rollout": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
        ({"agent": {"maxNewTokensPerTurn": 1024, "maxTotalTokens": 512}}, "maxNewTokensPerTurn"),
        ({"grpo": {"microBatchSize": 64, "groupSize": 2, "questionsPerStep": 2}}, "microBatchSize"),
        ({"weightSync": {"redis": {"externalUrl": "redis://r:6379"}}}, "passwordSecret"),
        ({"rollout": {"engine": "vllm"}}, "gpus"),
        ({"grpo": {"groupSize": 1}}, "groupSize"),
        ({"trainer": {"gangProvider": "yunikorn"}}, "gangProvider"),
        ({"grpo": {"learningRate": 0}}, "learningRate"),
        ({"rollout": {"resources": {"memory": "lots"}}}, "memory"),
        ({"grpo": {"groupsize": 4}}, "groupsize"),
        # Reserved GPUs nothing would use: one process per trainer pod, one device per hf engine.
        ({"trainer": {"resources": {"gpus": 2}}}, "one rank on one GPU"),
        ({"rollout": {"resources": {"gpus": 2}}}, "engine hf serves from one GPU"),
        # vLLM's GGUF layers are quantized: the weight push would fail on the first sync.
        (
            {"model": {"name": "m", "ggufFile": "m.gguf"}, "rollout": {"engine": "vllm", "resources": {"gpus": 1}}},
            "cannot serve model.ggufFile",
        ),
        ({"eval": {"split": "validation"}}, "set data.validationQuestions"),
    ],
)
def test_bad_specs_are_refused(spec: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        RLJobSpec.model_validate(spec)
    assert needle in str(err.value)


def test_defaults_round_trip_through_yaml() -> None:
    job = RLJob.model_validate({"metadata": {"name": "a", "namespace": "b"}, "spec": {}})
    again = RLJob.model_validate(job.model_dump(by_alias=True))
    assert again == job


def test_vllm_may_shard_over_several_gpus_of_a_pod() -> None:
    from rljob.rollout.worker import engine_options

    job = RLJob.model_validate({"spec": {"rollout": {"engine": "vllm", "resources": {"gpus": 4}}}})
    assert engine_options(job) == {"tensor_parallel_size": 4}
    one = RLJob.model_validate({"spec": {"rollout": {"engine": "vllm", "resources": {"gpus": 1}}}})
    assert engine_options(one) == {} and engine_options(RLJob.model_validate({"spec": {}})) == {}


def test_each_cross_field_rule_reaches_the_crd_with_the_message_python_raises() -> None:
    """One `Rule` per cross-field check: its CEL and message are in the generated CRD, as the same
    pair, so `kubectl apply` and a local run refuse a spec with the same words."""
    from rljob import config
    from rljob_operator.crd import build_crd

    def pairs(node: object) -> set[tuple[str, str]]:
        found: set[tuple[str, str]] = set()
        if isinstance(node, dict):
            for entry in node.get("x-kubernetes-validations", []):
                found.add((entry["rule"], entry["message"]))
            for value in node.values():
                found |= pairs(value)
        elif isinstance(node, list):
            for value in node:
                found |= pairs(value)
        return found

    in_crd = pairs(build_crd())
    models = [m for m in vars(config).values() if isinstance(m, type) and issubclass(m, config.ApiModel)]
    rules = {(rule.cel, rule.message) for model in models for rule in model.RULES}
    assert len(rules) >= 9 and rules <= in_crd
