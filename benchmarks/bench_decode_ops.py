"""Three decode-step operations the transformers engine changed, each timed against what it replaced.

- attention scores in bf16 over the KV cache: a matmul on a strided view of a buffer with spare
  room (what `GrowingLayer.keys` is) against the whole contiguous buffer (what decode attention
  reads since `attention.whole_buffers`); 62 rows x 3 KV heads x 3 query heads, 500 of 564 positions;
- one token and its log-prob per row from 64 x 49,152 bf16 logits at T = 0.8: a log-softmax and
  `torch.multinomial` (before issue 21), and a log-softmax and one cumulative sum over the
  vocabulary (the sampler until 5ff5c0b), against `hf.sample_tokens` (in place, a two-level CDF
  inversion);
- the bf16 linear products of one decode step of the bundled SmolLM2-135M (30 layers of q, k, v,
  o, gate, up and down, and the 49,152-way head; its own weights, 64 rows): torch's `linear`, which
  lets oneDNN reorder each weight on every call (before `engines.packed_linear`), against
  `PackedLinear`, whose weights were reordered once.
One thread. Prints ratios side by side and the JSON summary as its last line:
  python benchmarks/bench_decode_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import finish, progress

from rljob.assets import smollm2_model_dir
from rljob.config import ModelSpec
from rljob.engines.base import TurnParams
from rljob.engines.hf import sample_tokens
from rljob.engines.models import load_model
from rljob.engines.packed_linear import PackedLinear


def _ms(fn, reps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 5 if args.quick else 30
    rows, heads, groups, length, dim, capacity = 62, 3, 3, 500, 64, 564
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(rows, heads, capacity, dim, generator=gen).to(torch.bfloat16)
    query = torch.randn(rows, heads, groups, dim, generator=gen).to(torch.bfloat16)
    view = buffer[:, :, :length]
    strided = _ms(lambda: torch.matmul(query, view.transpose(-1, -2)), reps)
    whole = _ms(lambda: torch.matmul(query, buffer.transpose(-1, -2)), reps)
    progress(f"bf16 scores: strided view {strided:.2f} ms, whole buffer {whole:.2f} ms: x{strided / whole:.2f}")
    logits = (torch.randn(64, 49_152, generator=gen) * 4).to(torch.bfloat16)
    params = TurnParams(max_new_tokens=[1] * 64, temperature=0.8)

    def multinomial_step() -> None:
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        logp.gather(-1, torch.multinomial(logp.exp(), 1, generator=gen))

    def one_cumsum_step() -> None:
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        cdf = logp.exp().cumsum(-1)
        u = torch.rand((logp.shape[0], 1), generator=gen) * cdf[:, -1:]
        logp.gather(-1, torch.searchsorted(cdf, u, right=True).clamp_(max=logp.shape[-1] - 1))

    multinomial = _ms(multinomial_step, reps)
    one_cumsum = _ms(one_cumsum_step, reps)
    cdf = _ms(lambda: sample_tokens(logits, params, gen), reps)
    progress(
        f"sampling 64 x 49,152: log-softmax + torch.multinomial {multinomial:.2f} ms, log-softmax + one cumsum "
        f"{one_cumsum:.2f} ms, sample_tokens {cdf:.2f} ms: x{multinomial / cdf:.2f} and x{one_cumsum / cdf:.2f}"
    )
    model = load_model(ModelSpec(name=str(smollm2_model_dir()), dtype="bfloat16"))
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    inputs = {w: torch.randn(64, w, generator=gen).to(torch.bfloat16) for w in {m.in_features for m in layers}}
    packed_layers = [PackedLinear(layer) for layer in layers]

    def step(modules: list[torch.nn.Module]) -> None:
        with torch.inference_mode():
            for module in modules:
                module(inputs[module.in_features])

    plain_linear = _ms(lambda: step(layers), max(reps // 3, 2))
    packed_linear = _ms(lambda: step(packed_layers), max(reps // 3, 2))
    progress(
        f"a decode step's bf16 linear products at 64 rows: torch's linear {plain_linear:.1f} ms, weights reordered "
        f"once {packed_linear:.1f} ms: x{plain_linear / packed_linear:.2f}"
    )
    finish(
        "decode_ops_quick" if args.quick else "decode_ops",
        {
            "scores_strided_ms": strided,
            "scores_whole_buffer_ms": whole,
            "scores_speedup": strided / whole,
            "multinomial_ms": multinomial,
            "sample_tokens_ms": cdf,
            "sampling_speedup": multinomial / cdf,
            "one_cumsum_ms": one_cumsum,
            "sampler_change_speedup": one_cumsum / cdf,
            "linear_plain_ms": plain_linear,
            "linear_packed_ms": packed_linear,
            "linear_speedup": plain_linear / packed_linear,
        },
    )


if __name__ == "__main__":
    main()
