"""Supervised protocol warm-up: demonstrations from train questions, then masked-token SFT."""

from rljob.warmup.demonstrations import Demonstration, build_demonstrations, load_records
from rljob.warmup.sft import WarmupError, WarmupResult, run_sft, warmup_for_job

__all__ = [
    "Demonstration",
    "WarmupError",
    "WarmupResult",
    "build_demonstrations",
    "load_records",
    "run_sft",
    "warmup_for_job",
]
