"""Transformers engine throughput on CPU: one batched call against one sequence at a time.

SmolLM2-135M-Instruct (GGUF, dequantised to float32) generates a fixed number of sampled tokens for
N agent prompts (no stop strings, so every sample runs to the budget). Also times a second turn
with and without KV-cache reuse (the first turn's cache extended by an injected block).
  python benchmarks/bench_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import RESULTS, finish, progress

from rljob.agent.prompt import information_block, prompt_ids
from rljob.assets import hotpotqa_file, smollm2_model_dir
from rljob.config import ModelSpec
from rljob.data.hotpotqa import load_questions
from rljob.engines.base import TurnParams
from rljob.engines.hf import HFEngine


def _timed(engine: HFEngine, contexts: list[list[int]], tokens: int) -> tuple[float, int, list]:
    params = TurnParams(max_new_tokens=[tokens] * len(contexts), temperature=1.0)
    started = time.perf_counter()
    outs = engine.generate(contexts, params)
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outs), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 prompts x 24 tokens")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, tokens = (4, 24) if args.quick else (args.batch, args.tokens)
    model_dir = smollm2_model_dir()
    spec = ModelSpec(name=str(model_dir), dtype="float32")
    engine = HFEngine.from_spec(spec, device="cpu", seed=0, reuse_cache=False)
    # the eos token is removed from the stop set so that every sample runs the full budget
    engine.eos_ids = set()
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=batch)
    contexts = [prompt_ids(engine.tokenizer, q.question) for q in questions]
    _timed(engine, contexts[:1], 4)  # warm-up

    sequential_s, sequential_tokens = 0.0, 0
    for i, ctx in enumerate(contexts):
        s, n, _ = _timed(engine, [ctx], tokens)
        sequential_s += s
        sequential_tokens += n
        progress(f"sequential {i + 1}/{batch}: {n / s:.1f} tok/s")
    batched_s, batched_tokens, first = _timed(engine, contexts, tokens)
    progress(f"batched x{batch}: {batched_tokens / batched_s:.1f} tok/s")

    # Second turn: context + turn 1 + an injected observation, with and without cache reuse.
    block = engine.tokenizer.encode(information_block(questions[0].context[:3], 60), add_special_tokens=False)
    engine.reuse_cache = True
    _, _, first = _timed(engine, contexts, tokens)  # turn 1 fills the cache
    second = [c + o.token_ids + block for c, o in zip(contexts, first, strict=True)]
    reuse_s, reuse_tokens, _ = _timed(engine, second, tokens)  # prefills only the new suffixes
    engine.reuse_cache = False
    engine.reset_cache()
    fresh_s, fresh_tokens, _ = _timed(engine, second, tokens)  # the same contexts, prefilled whole
    progress(f"turn 2 fresh prefill: {fresh_tokens / fresh_s:.1f} tok/s; reuse: {reuse_tokens / reuse_s:.1f} tok/s")
    summary = {
        "benchmark": "engine_hf",
        "quick": args.quick,
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "threads": args.threads,
        "batch": batch,
        "new_tokens": tokens,
        "prompt_tokens_mean": sum(map(len, contexts)) / batch,
        "sequential_tokens_per_s": sequential_tokens / sequential_s,
        "batched_tokens_per_s": batched_tokens / batched_s,
        "batched_speedup": (batched_tokens / batched_s) / (sequential_tokens / sequential_s),
        "turn2_fresh_prefill_tokens_per_s": fresh_tokens / fresh_s,
        "turn2_cache_reuse_tokens_per_s": reuse_tokens / reuse_s,
        "turn2_reuse_speedup": (reuse_tokens / reuse_s) / (fresh_tokens / fresh_s),
    }
    progress(f"{'tok/s':24}{'sequential':>12}{'batched':>12}{'ratio':>8}")
    progress(
        f"{'turn 1':24}{summary['sequential_tokens_per_s']:12.1f}{summary['batched_tokens_per_s']:12.1f}"
        f"{summary['batched_speedup']:8.2f}"
    )
    progress(
        f"{'turn 2 (fresh vs reuse)':24}{summary['turn2_fresh_prefill_tokens_per_s']:12.1f}"
        f"{summary['turn2_cache_reuse_tokens_per_s']:12.1f}{summary['turn2_reuse_speedup']:8.2f}"
    )
    _plot(summary)
    finish("engine_quick" if args.quick else "engine", summary)


def _plot(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = ["one at a time", f"batched x{summary['batch']}", "turn 2 fresh", "turn 2 cache reuse"]
    values = [
        summary["sequential_tokens_per_s"],
        summary["batched_tokens_per_s"],
        summary["turn2_fresh_prefill_tokens_per_s"],
        summary["turn2_cache_reuse_tokens_per_s"],
    ]
    ax.bar(labels, values, color=["#999", "#37c", "#999", "#37c"])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"HF engine, SmolLM2-135M, CPU x{summary['threads']} threads")
    fig.tight_layout()
    fig.savefig(RESULTS / ("engine_quick.png" if summary["quick"] else "engine.png"), dpi=100)


if __name__ == "__main__":
    main()
