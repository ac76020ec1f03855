"""Supervised protocol warm-up: demonstrations from train questions, then masked-token SFT."""

from rljob.warmup.demonstrations import build_demonstrations
from rljob.warmup.sft import WarmupError, run_sft, warmup_for_job

__all__ = [
    "WarmupError",
    "build_demonstrations",
    "run_sft",
    "warmup_for_job",
]
