"""The GRPO trainer gang: pure update maths, the in-process step, and the Redis loop.

`GRPOTrainer.train_step` needs no Redis (tests call it directly); `run_trainer` is the
gang's entry point that wires it to the job's streams, weight store, metrics and checkpoints.
"""

from rljob.trainer.grpo import GRPOTrainer, StepStats, frozen_copy

__all__ = ["GRPOTrainer", "StepStats", "frozen_copy", "run_trainer"]


def run_trainer(*args, **kwargs):
    """See `rljob.trainer.loop.run_trainer` (imported lazily: it pulls in redis and the weight store)."""
    from rljob.trainer.loop import run_trainer as _run

    return _run(*args, **kwargs)
