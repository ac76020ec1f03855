"""On the real model, in the precision this CPU gets and in bf16: the engine's behaviour log-probs
and the trainer's recomputation agree (mean importance weight near 1 at lag 0), as the GRPO ratio
needs."""

from __future__ import annotations

import pytest
import torch

from rljob.agent.prompt import prompt_ids
from rljob.assets import hotpotqa_file, smollm2_model_dir
from rljob.config import GRPOSpec, ModelSpec
from rljob.data.hotpotqa import load_questions
from rljob.engines.base import TurnParams
from rljob.engines.hf import HFEngine
from rljob.precision import compute_dtype
from rljob.protocol import Trajectory, TrajectoryGroup
from rljob.trainer.grpo import GRPOTrainer
from rljob.trainer.model import load_policy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
TEMPERATURE = 0.8


# bf16 on every CPU (a slow one too), and "auto" as well where it means fp32.
SPEC_DTYPES = ["bfloat16"] + (["auto"] if compute_dtype("auto", "cpu") != torch.bfloat16 else [])


@pytest.mark.parametrize("spec_dtype", SPEC_DTYPES)
def test_engine_and_trainer_agree_on_smollm2(spec_dtype: str) -> None:
    spec = ModelSpec(name=str(smollm2_model_dir()), dtype=spec_dtype)
    dtype = compute_dtype(spec.dtype, "cpu")
    engine = HFEngine.from_spec(spec, seed=0)
    assert next(engine.model.parameters()).dtype == dtype
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=2)
    contexts = [prompt_ids(engine.tokenizer, q.question) for q in questions for _ in range(4)]
    outs = engine.generate(contexts, TurnParams(max_new_tokens=[24] * len(contexts), temperature=TEMPERATURE))
    groups = []
    for g in range(2):
        trajs = []
        for i in range(4):
            ctx, out = contexts[4 * g + i], outs[4 * g + i]
            mask = [0] * len(ctx) + [1] * len(out.token_ids)
            trajs.append(
                Trajectory(
                    token_ids=ctx + out.token_ids,
                    prompt_length=len(ctx),
                    loss_mask=mask,
                    behaviour_logprobs=[0.0] * len(ctx) + out.logprobs,
                    policy_version=0,
                    reward=float(i % 2),
                )
            )
        groups.append(
            TrajectoryGroup(request_id=f"r{g}", step=0, question_id=f"q{g}", worker_id="w", trajectories=trajs)
        )
    grpo = GRPOSpec(group_size=4, questions_per_step=2)
    trainer = GRPOTrainer(load_policy(spec), None, grpo, temperature=TEMPERATURE, compute_dtype=dtype)
    stats = trainer.train_step(groups, 0)
    assert stats.updated and stats.tokens > 100
    assert abs(stats.importance_weight - 1.0) < 0.02, stats.importance_weight
    assert torch.isfinite(torch.tensor(stats.loss))
