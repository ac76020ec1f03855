"""The GRPO trainer gang: pure update maths, the in-process step, and the Redis loop.

`grpo.GRPOTrainer.train_step` needs no Redis (tests call it directly); `loop.run_trainer` is the
gang's entry point that wires it to the job's streams, weight store, metrics and checkpoints.
"""
