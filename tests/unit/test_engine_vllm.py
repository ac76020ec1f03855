"""The vLLM engine behind the shared interface; runs only where vLLM imports and a GPU is present."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (needs its CUDA wheel and pinned torch)")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from rljob.assets import hotpotqa_file
    from rljob.config import ModelSpec
    from rljob.data.hotpotqa import load_questions
    from rljob.engines import load_engine
    from support.tiny_models import save_tiny_model

    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=60)
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"), [q.question for q in questions], vocab_size=400)
    spec = ModelSpec(name=str(folder), dtype="bfloat16")
    return load_engine(spec, "vllm", "cuda", gpu_memory_utilization=0.2, max_model_len=1024)


def test_generate_returns_tokens_logprobs_and_stops(engine) -> None:
    from rljob.engines.base import TurnParams

    contexts = [engine.tokenizer.encode("Which city is the capital of France?")] * 3
    outs = engine.generate(contexts, TurnParams(max_new_tokens=[5, 9, 12], temperature=1.0, stop=("e",)))
    for out, budget in zip(outs, [5, 9, 12], strict=True):
        assert 1 <= len(out.token_ids) <= budget and len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.logprobs)
        assert out.finish_reason in {"stop", "length", "eos"}
        if out.finish_reason == "stop":
            assert out.stop_string == "e"


def test_greedy_is_deterministic(engine) -> None:
    from rljob.engines.base import TurnParams

    ctx = [engine.tokenizer.encode("Who wrote it")] * 2
    a, b = engine.generate(ctx, TurnParams(max_new_tokens=[8, 8], greedy=True))
    assert a.token_ids == b.token_ids


def test_sync_pushes_changed_tensors(engine) -> None:
    class OneChange:
        def sync(self, target):
            name = next(iter(target))
            target[name].zero_()
            from rljob.weights import SyncResult

            return SyncResult(version=3, changed=[name])

    outcome = engine.sync_weights(OneChange())
    assert outcome.version == 3 and engine.policy_version == 3
