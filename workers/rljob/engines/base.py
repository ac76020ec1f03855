"""The generation-engine interface the multi-turn agent drives, shared by transformers and vLLM.

One call generates one turn for every active sample: `generate(contexts, params)` takes the full
token ids of each sample so far and returns the new tokens with their behaviour log-probs. Engines
may reuse work across turns (KV cache, prefix cache) but callers never depend on it.

Behaviour log-probs are those of the distribution actually sampled from: log softmax(logits / T),
restricted to and renormalised over the top-p nucleus when top_p < 1. Greedy decoding records
log softmax(logits) at T = 1. The trainer divides its logits by the same temperature.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

from rljob.weights.reader import SyncResult


@dataclass(frozen=True)
class TurnParams:
    """Sampling settings of one turn; `max_new_tokens` is per sample (budgets differ)."""

    max_new_tokens: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (a stop string), "eos" or "length"
    stop_string: str | None = None


class WeightSyncer(Protocol):
    """What the engines need from the weight store's reader (rljob.weights.WeightReader)."""

    def sync(self, target: Any) -> SyncResult: ...


class GenerationEngine(abc.ABC):
    """Batched turn generation plus in-place weight updates."""

    tokenizer: Any
    policy_version: int = 0

    @abc.abstractmethod
    def generate(self, contexts: list[list[int]], params: TurnParams) -> list[Completion]:
        """Generate one turn for each context (one batched pass over all of them)."""

    @abc.abstractmethod
    def sync_weights(self, reader: WeightSyncer) -> SyncResult:
        """Bring the served weights to the store's latest version; sets `policy_version`."""
