"""A rollout worker applies version 0 even though it already loaded the model: with a warm-up,
version 0 is not the checkpoint the worker read from disk (real redis-server and weight store)."""

from __future__ import annotations

import pytest
import torch

from rljob.config import WeightSyncSpec
from rljob.engines.hf import HFEngine
from rljob.keys import JobKeys
from rljob.rollout.worker import WorkerSummary, _sync
from rljob.weights import WeightPublisher, WeightReader
from support.tiny_models import tiny_random_model, train_tiny_tokenizer

pytestmark = pytest.mark.integration


def test_worker_applies_a_version_0_that_differs_from_its_loaded_weights(redis_client):
    tokenizer = train_tiny_tokenizer(["<search> a b c </search> <answer> d </answer>"] * 4, 300)
    served = tiny_random_model(tokenizer, seed=0)
    warmed = tiny_random_model(tokenizer, seed=1)  # stands in for the warmed-up trainer policy
    keys = JobKeys("test", "warm")
    WeightPublisher.from_spec(redis_client, keys, WeightSyncSpec(chunk_bytes=65536)).publish(warmed)
    engine = HFEngine(served, tokenizer)
    assert engine.policy_version == 0  # a fresh engine calls its own weights version 0
    _sync(engine, WeightReader(redis_client, keys), WorkerSummary("w"))
    for name, value in warmed.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value.to(torch.bfloat16).float()), name


def test_worker_replaces_a_version_redis_lost_even_under_the_same_number(redis_client):
    # The worker served v0 of one publish; Redis lost it and a restarted trainer published another
    # v0. The number matches what the engine serves; the publish id does not.
    from rljob.weights import store

    tokenizer = train_tiny_tokenizer(["<search> a b c </search> <answer> d </answer>"] * 4, 300)
    first, second = tiny_random_model(tokenizer, seed=1), tiny_random_model(tokenizer, seed=2)
    keys = JobKeys("test", "aba")
    spec = WeightSyncSpec(chunk_bytes=65536)
    WeightPublisher.from_spec(redis_client, keys, spec).publish(first)
    engine, reader = HFEngine(tiny_random_model(tokenizer, seed=0), tokenizer), WeightReader(redis_client, keys)
    _sync(engine, reader, WorkerSummary("w"))
    store.drop_versions(redis_client, keys, [0])  # what the restarted Redis no longer has
    redis_client.delete(keys.weights_latest, keys.weights_latest_id)
    WeightPublisher.from_spec(redis_client, keys, spec).publish(second)
    _sync(engine, reader, WorkerSummary("w"))
    assert engine.policy_version == 0
    for name, value in second.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value.to(torch.bfloat16).float()), name
