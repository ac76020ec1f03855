"""vLLM engine, written against vLLM's public API (LLM, SamplingParams, collective_rpc).

Turns: one `LLM.generate` call per turn over all active samples, prompts given as token ids, stop
strings `</search>` / `</answer>` kept in the output; automatic prefix caching reuses the KV cache of
earlier turns. Behaviour log-probs: `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) makes the
returned log-prob the one of the tempered, top-p filtered distribution actually sampled, matching
the transformers engine; older vLLM returns raw-model log-probs and the engine warns.

Weights: a CPU bf16 shadow dict of HF-named tensors is the sync target of the weight store's
reader; the tensors it reports `changed` are pushed into the served model with its `load_weights`
(run inside each vLLM worker through `collective_rpc`), and the prefix cache is reset.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from rljob.config import ModelSpec
from rljob.engines.base import Completion, GenerationEngine, TurnParams, WeightSyncer
from rljob.engines.models import load_model, model_source
from rljob.weights.reader import SyncResult

log = logging.getLogger(__name__)


def _load_weights_in_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside a vLLM worker process: load HF-named tensors into the served model."""
    model = worker.model_runner.model
    model.load_weights(weights=[(name, t.to(worker.device)) for name, t in weights])
    return len(weights)


class VLLMEngine(GenerationEngine):
    def __init__(
        self, spec: ModelSpec, device: str = "cuda", seed: int = 0, gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None, **llm_kwargs: Any,
    ) -> None:  # fmt: skip
        from vllm import LLM

        name, extra = model_source(spec)
        kwargs: dict[str, Any] = {
            "model": name if "gguf_file" not in extra else f"{name}/{extra['gguf_file']}",
            "dtype": spec.dtype,
            "seed": seed,
            "enable_prefix_caching": True,
            "gpu_memory_utilization": gpu_memory_utilization,
            **llm_kwargs,
        }
        if "gguf_file" in extra:
            kwargs["tokenizer"] = name
        if spec.revision:
            kwargs["revision"] = spec.revision
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.processed_logprobs = _supports_processed_logprobs()
        if self.processed_logprobs:
            kwargs["logprobs_mode"] = "processed_logprobs"
        else:
            log.warning("this vLLM returns raw log-probs: behaviour log-probs ignore temperature/top-p")
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.spec = spec
        self.policy_version = 0
        self._shadow: dict[str, torch.Tensor] | None = None

    def generate(self, contexts: list[list[int]], params: TurnParams) -> list[Completion]:
        from vllm import SamplingParams

        if not contexts:
            return []
        greedy = params.greedy or params.temperature == 0.0
        sampling = [
            SamplingParams(
                n=1,
                max_tokens=budget,
                temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p,
                stop=list(params.stop),
                include_stop_str_in_output=True,
                logprobs=1,
                skip_special_tokens=True,
            )
            for budget in params.max_new_tokens
        ]
        prompts = [{"prompt_token_ids": list(ctx)} for ctx in contexts]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, sample.logprobs or [], strict=True)]
            stop = sample.stop_reason if isinstance(sample.stop_reason, str) else None
            if sample.finish_reason == "length":
                reason = "length"
            elif stop is not None:
                reason = "stop"
            else:
                reason = "eos"
            completions.append(Completion(ids, lps, sample.text, reason, stop))
        return completions

    def _shadow_weights(self) -> dict[str, torch.Tensor]:
        """HF-named bf16 CPU copies of the served weights: the weight reader's sync target."""
        if self._shadow is None:
            cpu_model = load_model(self.spec.model_copy(update={"dtype": "bfloat16"}), "cpu")
            self._shadow = {k: v.detach().to(torch.bfloat16).clone() for k, v in cpu_model.state_dict().items()}
            del cpu_model
        return self._shadow

    def sync_weights(self, reader: WeightSyncer) -> SyncResult:
        shadow = self._shadow_weights()
        outcome = reader.sync(shadow)
        if outcome.changed:
            weights = [(name, shadow[name]) for name in outcome.changed]
            self.llm.collective_rpc(_load_weights_in_worker, args=(weights,))
            self.llm.reset_prefix_cache()
        self.policy_version = outcome.version
        return outcome


def _supports_processed_logprobs() -> bool:
    try:
        from vllm.config import ModelConfig

        return "logprobs_mode" in inspect.signature(ModelConfig).parameters or hasattr(ModelConfig, "logprobs_mode")
    except Exception:
        return False
