"""vLLM engine, written against vLLM's public API (LLM, SamplingParams, collective_rpc).

Turns: one `LLM.generate` call per turn over all active samples, prompts given as token ids, stop
strings `</search>` / `</answer>` kept in the output; automatic prefix caching reuses the KV cache of
earlier turns. Behaviour log-probs: `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) makes the
returned log-prob the one of the tempered, top-p filtered distribution actually sampled, matching
the transformers engine; older vLLM returns raw-model log-probs and the engine warns.

Weights: a CPU bf16 shadow dict of HF-named tensors is the sync target of the weight store's
reader; the tensors it reports `changed` are pushed into the served model with its `load_weights`
(run inside each vLLM worker through `collective_rpc`), and the prefix cache is reset. The engine
core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): in its default separate process,
`collective_rpc` sends its arguments with msgpack, which refuses a Python function unless
insecure serialization is allowed, and even then delivers the tensors as plain lists (vLLM
0.8.5-0.11 `serial_utils` and `EngineCore`'s untyped decoder). In process, one GPU runs the call
directly; several (tensor parallel over `rollout.resources.gpus`) get it pickled to their workers.
"""

from __future__ import annotations

import logging
import os
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
    def __init__(self, spec: ModelSpec, seed: int = 0, gpu_memory_utilization: float = 0.5, **llm_kwargs: Any) -> None:
        """`llm_kwargs` go to `vllm.LLM` as they are (`tensor_parallel_size`, `max_model_len`, ...)."""
        _engine_in_this_process()
        import vllm
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
        self.processed_logprobs = _supports_processed_logprobs(vllm.__version__)
        if self.processed_logprobs:
            kwargs["logprobs_mode"] = "processed_logprobs"
        else:
            log.warning("this vLLM returns raw log-probs: behaviour log-probs ignore temperature/top-p")
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.spec = spec
        self._shadow: dict[str, torch.Tensor] | None = None
        self._unpushed: set[str] = set()  # shadow tensors a failed push left out of the served model

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
        """Bring the shadow to the newest version and push what changed into the served model.

        The reader advances the shadow before the push; if the push fails, the tensors it carried
        are remembered and pushed with the next sync (the reader will not report them again), and
        the served version is not advanced."""
        shadow = self._shadow_weights()
        outcome = reader.sync(shadow)
        self._unpushed.update(outcome.changed)
        if self._unpushed:
            weights = [(name, shadow[name]) for name in sorted(self._unpushed)]
            self.llm.collective_rpc(_load_weights_in_worker, args=(weights,))
            self._unpushed.clear()
            if self.llm.reset_prefix_cache() is False:
                # vLLM keeps the cache while blocks are in use; cached prefixes would mix old weights' KV
                # into the next rollouts, so this is worth a loud line (nothing is generating between syncs).
                log.warning("vLLM did not reset its prefix cache after a weight update")
        self.policy_version = outcome.version
        return outcome


def _engine_in_this_process() -> None:
    """Run vLLM's engine core in this process, so `collective_rpc` can carry the weight push (see
    the module docstring). Set before `LLM(...)`: newer vLLM reads its environment once."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        log.info("setting VLLM_ENABLE_V1_MULTIPROCESSING=0: weight updates need the engine in this process")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _supports_processed_logprobs(version: str) -> bool:
    """Whether this vLLM samples the log-probs it returns after temperature and top-p: from 0.10.2.
    0.10.0-0.10.1 already accept `logprobs_mode` but compute the log-probs before both."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release >= (0, 10, 2)
    except InvalidVersion:
        return False
