"""Weight sync through Redis: bf16 deltas vs full safetensors exports, on SmolLM2-135M-Instruct.

Two workloads, both through the real store (`WeightPublisher` / `WeightReader`) and a real
redis-server on loopback (no AOF, so disk speed does not enter the numbers):

1. real optimizer steps (not in --quick): fp32 master weights, AdamW at lr 1e-6, on a
   language-model loss over random tokens (a stand-in for the GRPO gradient: same optimizer, same
   update sizes, no rollouts);
2. a synthetic sweep of change density (0.1% .. 10%) on the model's own bf16 values, each changed
   value moved by 1 ulp (80%) or 2 ulp (20%) up or down, as small-lr updates do. By default the
   publisher is given fp32 tensors, as a trainer's masters are, so every version pays the
   fp32 -> bf16 cast (`--source bf16` skips it, as the first version of this benchmark did).

For each version: changed fraction, bytes per changed value, delta size as % of the full bf16
size, encode throughput (the publisher's threads) and decode+apply throughput (one thread), and
publish-to-applied latency with 1 and 4 readers, beside (a) a full safetensors sync through the
same store, measured in the same run, and (b) the plain coding of an int32 position and a bf16
value per change (6 bytes). Latencies are the best of `--reps` versions (and the full baseline the
best of two), because the machine is shared; decode+apply the best of `--decode-tries` runs into
fresh copies of the readers' tensors per version (a real AdamW step is one version, and one run
of it swung 0.76-1.20 GB/s between two benchmark runs of the same code), with the median of every
run beside it. After every version every reader is compared with the truth (`lossless`), and no
reader may have recovered from an error or fallen back to a full (`clean_syncs`: a wrong delta
decode would otherwise pass, healed by a full). Bytes per change are given for the payload and
with the manifest. CPU seconds of this
process (publisher + readers, not redis-server) are recorded beside them as a load-independent
view. Progress on stdout; the JSON summary is the last line. Readers run as threads of this
process (numpy releases the GIL for the heavy work). The publisher and each reader spread their
per-tensor work over `--weight-threads` threads (default: the usable cores); `--weight-threads 1`
is the single-threaded store.

Weights come from `rljob.assets.smollm2_model_dir()` (the GGUF dequantised once and cached as
safetensors; the first run on a machine pays that conversion, minutes on a small CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from rljob.embedded_redis import EmbeddedRedis
from rljob.keys import JobKeys
from rljob.weights import WeightPublisher, WeightReader, store
from rljob.weights.apply import apply_stream
from rljob.weights.checksum import bf16_bits, format_sum
from rljob.weights.codec import EncodedDelta, from_ordered, to_ordered
from rljob.weights.parallel import default_threads
from rljob.weights.reader import verify_checksums

DENSITIES = [0.001, 0.005, 0.01, 0.03, 0.10]
PLAIN_BYTES_PER_CHANGE = 6  # int32 position + bf16 value
CHUNK_BYTES = 16 * 1024 * 1024
WEIGHT_THREADS = 1  # threads of each publisher and reader (set from --weight-threads)
DECODE_TRIES = 3  # decode+apply runs per version, the best kept (set from --decode-tries)
SOURCES = {
    "fp32": "fp32 tensors holding bf16 values (the publisher casts every version)",
    "bf16": "bf16 tensors (no cast)",
}


def log(message: str) -> None:
    print(message, flush=True)


# SmolLM2-135M-Instruct's architecture (from its config.json), for `--weights random`: the same 272
# tensors and 134.5M values with a seeded random init, where the model file cannot be had (a GPU
# machine that reaches nothing and takes 64 MiB of files along).
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32 masters)",
    "random": "SmolLM2-135M-Instruct's shapes, random init (transformers' Llama init, seed 0), fp32 masters",
}
WEIGHTS = "smollm2"


def random_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).float()


def load_model() -> torch.nn.Module:
    if WEIGHTS == "random":
        return random_model().train()
    from transformers import AutoModelForCausalLM

    from rljob.assets import smollm2_model_dir

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_model_dir()), dtype=torch.float32)
    return model.train()


def load_weights() -> dict[str, torch.Tensor]:
    """The fp32 weights alone (for SmolLM2 no transformers import: keeps --quick quick)."""
    if WEIGHTS == "random":
        return {name: p.detach() for name, p in random_model().named_parameters()}
    import safetensors.torch

    from rljob.assets import smollm2_model_dir

    return safetensors.torch.load_file(str(smollm2_model_dir() / "model.safetensors"))


def bf16_shadow(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.bfloat16).clone() for name, t in weights.items()}


def nudge(bits: dict[str, np.ndarray], density: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Move `density` of all values by +-1 ulp (80%) or +-2 ulp (20%)."""
    out = {}
    for name, flat in bits.items():
        new = flat.copy()
        picked = np.flatnonzero(rng.random(flat.size) < density)
        steps = np.where(rng.random(picked.size) < 0.8, 1, 2) * rng.choice([-1, 1], size=picked.size)
        ordered = to_ordered(new[picked]).astype(np.int32) + steps
        new[picked] = from_ordered(np.clip(ordered, -32768, 32767).astype(np.int16))
        out[name] = new
    return out


def as_tensors(bits: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(b.view(np.int16)).view(torch.bfloat16).reshape(shapes[n]) for n, b in bits.items()}


def as_fp32(bits: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """fp32 tensors holding the bf16 values exactly (what a trainer's masters round to)."""
    return {
        n: torch.from_numpy(b.astype(np.uint32) << 16).view(torch.float32).reshape(shapes[n]) for n, b in bits.items()
    }


class Readers:
    """N readers, each with its own bf16 shadow; syncs them concurrently and times the slowest."""

    def __init__(self, client, keys: JobKeys, shadows: list[dict[str, torch.Tensor]]) -> None:
        self.readers = [WeightReader(client, keys, threads=WEIGHT_THREADS) for _ in shadows]
        self.shadows = shadows

    def sync(self) -> tuple[float, list, float]:
        """(wall seconds, results, CPU seconds of this process)."""
        results: list = [None] * len(self.readers)

        def run(i: int) -> None:
            results[i] = self.readers[i].sync(self.shadows[i])
            settle(self.shadows[i])

        started, cpu = time.perf_counter(), time.process_time()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.readers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - started, results, time.process_time() - cpu


def settle(tensors: dict[str, torch.Tensor]) -> None:
    """Wait for queued GPU writes into `tensors`, so a timing covers them (CUDA kernels are
    asynchronous: a scatter may still be running when the call that queued it returns)."""
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()


def decode_apply_seconds(
    client, keys: JobKeys, version: int, base: dict[str, torch.Tensor]
) -> tuple[float, float, float, list[float]]:
    """Time decode+apply+change-sum check of one delta into bf16 tensors (fetch excluded), the
    best of `DECODE_TRIES` runs, each into a fresh copy of `base`: wall and CPU seconds (one
    thread; on a shared machine CPU time is what "one core" delivers); the wall time of the
    SHA-256 window check after the last run (not part of decode+apply); and every run's wall time."""
    manifest = store.read_manifests(client, keys, [version])[0][0]
    payload = store.read_payload(client, manifest)
    best_wall = best_cpu = math.inf
    walls: list[float] = []
    for _ in range(DECODE_TRIES):
        targets = {n: t.clone() for n, t in base.items()}
        started, cpu = time.perf_counter(), time.thread_time()
        enc = EncodedDelta.from_meta(manifest.stream.model_dump(), payload)
        sizes = [math.prod(entry.shape) for entry in manifest.tensors]
        total, _ = apply_stream([targets[entry.name] for entry in manifest.tensors], sizes, enc)  # one thread
        assert format_sum(total) == manifest.change_sum
        settle(targets)
        walls.append(time.perf_counter() - started)
        best_wall, best_cpu = min(best_wall, walls[-1]), min(best_cpu, time.thread_time() - cpu)
    started = time.perf_counter()
    verify_checksums(targets, manifest, [entry.name for entry in manifest.tensors if entry.checksum])
    return best_wall, best_cpu, time.perf_counter() - started, walls


def measure_full(client, named: dict[str, torch.Tensor], readers: int, shadows, tries: int = 1) -> dict[str, float]:
    """Baseline (a): publish the same weights as a full safetensors export and sync fresh readers
    (best of `tries`)."""
    best: dict[str, float] = {}
    for _ in range(tries):
        keys = JobKeys("bench", f"full-{readers}-{time.monotonic_ns()}")
        publisher = WeightPublisher(
            client,
            keys,
            rebase_interval=1,
            rebase_fraction=1.0,
            chunk_bytes=CHUNK_BYTES,
            mode="full",
            threads=WEIGHT_THREADS,
        )
        started, cpu = time.perf_counter(), time.process_time()
        result = publisher.publish(named)
        publish_seconds, publish_cpu = time.perf_counter() - started, time.process_time() - cpu
        sync_seconds, _, sync_cpu = Readers(client, keys, shadows[:readers]).sync()
        store.drop_versions(client, keys, store.committed_versions(client, keys))
        run = {
            "publish_s": publish_seconds,
            "sync_s": sync_seconds,
            "latency_s": publish_seconds + sync_seconds,
            "cpu_s": publish_cpu + sync_cpu,
            "bytes": result.bytes,
        }
        if not best or run["latency_s"] < best["latency_s"]:
            best = run
    return best


def record(
    kind: str,
    label: str,
    m: dict,
    numel: int,
    full_bytes: int,
    full: dict[int, dict[str, float]] | None,
    tries: list[dict],
) -> dict:
    """One row: sizes from the version `m`, latencies the best over `tries` (versions of this row)."""
    result = m["result"]
    model_bytes = numel * 2
    changed = max(result.changed, 1)
    lat1 = min(t["lat1"] for t in tries)
    lat4s = [t["lat4"] for t in tries if t["lat4"]]
    lat4 = min(lat4s) if lat4s else None
    sync1 = min(t["sync1"] for t in tries)
    cpu1 = min(t["cpu1"] for t in tries)
    row = {
        "workload": kind,
        "label": label,
        "version": result.version,
        "kind": result.kind,
        "changed_fraction": result.changed / numel,
        "bytes_per_changed_value": result.payload_bytes / changed,
        # The manifest too (tensor entries and the stream's metadata): every reader fetches it.
        "bytes_per_changed_value_with_manifest": result.bytes / changed,
        "delta_pct_of_full": 100.0 * result.payload_bytes / full_bytes,
        "plain_pct_of_full": 100.0 * PLAIN_BYTES_PER_CHANGE * result.changed / full_bytes,
        "size_vs_plain": result.payload_bytes / (PLAIN_BYTES_PER_CHANGE * changed),
        "encode_gbps": model_bytes / min(t["result"].encode_seconds for t in tries) / 1e9,
        "decode_apply_gbps": model_bytes / min(t["dec"] for t in tries) / 1e9,
        # Every run of every version of the row, not only the best: the machine is noisy.
        "decode_apply_gbps_median": model_bytes / statistics.median(w for t in tries for w in t["dec_all"]) / 1e9,
        "decode_apply_runs": sum(len(t["dec_all"]) for t in tries),
        "decode_apply_all_s": [w for t in tries for w in t["dec_all"]],
        "decode_apply_cpu_gbps": model_bytes / min(t["dec_cpu"] for t in tries) / 1e9,
        "verify_gbps": model_bytes / m["ver"] / 1e9 if m["ver"] else None,
        "publish_s": min(t["pub_s"] for t in tries),
        "latency_1_reader_s": lat1,
        "latency_1_reader_all_s": [t["lat1"] for t in tries],
        "latency_4_readers_s": lat4,
        "cpu_1_reader_s": cpu1,
        "full_latency_1_reader_s": full[1]["latency_s"] if full else None,
        "full_latency_4_readers_s": full[4]["latency_s"] if full and 4 in full else None,
        "speedup_1_reader": full[1]["latency_s"] / lat1 if full else None,
        "speedup_4_readers": full[4]["latency_s"] / lat4 if full and 4 in full and lat4 else None,
        # Reader side only: fetch + decode + apply + verify vs fetch + load + copy + verify of a full.
        "reader_speedup_1": full[1]["sync_s"] / sync1 if full else None,
        # CPU seconds of this process (publisher + 1 reader; redis-server not counted), same ratio.
        "cpu_speedup_1_reader": full[1]["cpu_s"] / cpu1 if full else None,
        "lossless": all(t["lossless"] for t in tries),  # every reader, after every version of the row
        "clean_syncs": all(t["clean"] for t in tries),  # no reader recovered or fell back to a full
    }
    full4 = f" / {full[4]['latency_s']:.3f}s" if full and 4 in full else ""
    log(
        f"  {label}: changed {row['changed_fraction'] * 100:.3f}%  {row['bytes_per_changed_value']:.2f} B/change  "
        f"delta {row['delta_pct_of_full']:.2f}% of full (plain {row['plain_pct_of_full']:.2f}%)  "
        f"encode {row['encode_gbps']:.2f} GB/s  decode+apply {row['decode_apply_gbps']:.2f} GB/s "
        f"(cpu {row['decode_apply_cpu_gbps']:.2f})  "
        f"latency 1r {lat1:.3f}s 4r {lat4 or 0:.3f}s"
        + (
            f" (full {full[1]['latency_s']:.3f}s{full4}; x{row['speedup_1_reader']:.1f}, "
            f"cpu x{row['cpu_speedup_1_reader']:.1f})"
            if full
            else ""
        )
    )
    return row


def publish_and_sync(
    publisher, named, one: Readers, four: Readers | None, keys, client, base, truth: dict[str, np.ndarray]
) -> dict:
    """Publish one version, sync every reader, time it; then check every reader against `truth`
    (the trainer's values cast to bf16, or the sweep's bits). A reader that applied the delta
    wrongly would still end right by refetching a full (its change sum catches it), so "clean"
    also requires that no reader recovered from an error or took a full it was not sent."""
    started, cpu = time.perf_counter(), time.process_time()
    result = publisher.publish(named)
    pub_s, pub_cpu = time.perf_counter() - started, time.process_time() - cpu
    sync1, results, sync1_cpu = one.sync()
    sync4 = None
    if four:
        sync4, res4, _ = four.sync()
        results = results + res4
    assert all(r.version == result.version for r in results)
    clean = all(not r.recovered_from and (result.kind == "full" or not r.took_full) for r in results)
    readers = one.shadows + (four.shadows if four else [])
    lossless = all(np.array_equal(bf16_bits(s[n], exact=True), truth[n]) for s in readers for n in truth)
    dec, dec_cpu, ver, dec_all = decode_apply_seconds(client, keys, result.version, base)
    return {
        "result": result,
        "pub_s": pub_s,
        "lat1": pub_s + sync1,
        "lat4": pub_s + sync4 if sync4 else None,
        "dec": dec,
        "dec_cpu": dec_cpu,
        "dec_all": dec_all,
        "ver": ver,
        "sync1": sync1,
        "cpu1": pub_cpu + sync1_cpu,
        "lossless": lossless,
        "clean": clean,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    synth = [r for r in rows if r["workload"] == "synthetic"]
    real = [r for r in rows if r["workload"] == "adamw-1e-6"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r["changed_fraction"] * 100 for r in synth]
    ax1.plot(x, [r["delta_pct_of_full"] for r in synth], "o-", label="delta (this store)")
    ax1.plot(x, [r["plain_pct_of_full"] for r in synth], "s--", label="plain int32 pos + bf16 (6 B/change)")
    ax1.axhline(100, color="grey", lw=1, label="full bf16 export")
    if real:
        ax1.plot(
            [r["changed_fraction"] * 100 for r in real],
            [r["delta_pct_of_full"] for r in real],
            "r*",
            ms=11,
            label="AdamW lr 1e-6 steps",
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="changed values (%)",
        ylabel="size (% of full bf16)",
        title="Delta size vs change density",
    )
    ax1.legend(fontsize=8)
    ax2.plot(x, [r["latency_1_reader_s"] for r in synth], "o-", label="delta, 1 reader")
    ax2.plot(x, [r["latency_4_readers_s"] for r in synth], "o-", label="delta, 4 readers")
    ax2.plot(x, [r["full_latency_1_reader_s"] for r in synth], "s--", label="full sync, 1 reader")
    ax2.plot(x, [r["full_latency_4_readers_s"] for r in synth], "s--", label="full sync, 4 readers")
    if real:
        ax2.plot(
            [r["changed_fraction"] * 100 for r in real],
            [r["latency_1_reader_s"] for r in real],
            "r*",
            ms=11,
            label="AdamW steps, 1 reader",
        )
    ax2.set(
        xscale="log",
        xlabel="changed values (%)",
        ylabel="publish-to-applied (s)",
        title="Latency on loopback (2 shared CPU cores)",
    )
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no optimizer steps, sweep on a slice, 1 try each")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (full mode)")
    parser.add_argument("--reps", type=int, default=2, help="versions per sweep density (best latency kept)")
    parser.add_argument("--decode-tries", type=int, default=3, help="decode+apply runs per version (best kept)")
    parser.add_argument(
        "--out",
        default=None,
        help="path stem for .json and .png (default docs/results/weight_delta; with --quick "
        "weight_delta_quick there, so a quick run never replaces the full results)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--weight-threads",
        type=int,
        default=default_threads(),
        help="threads of each publisher and reader (default: the usable cores)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the trainer's masters and the readers' shadows live (e.g. cuda: the publisher "
        "then finds changes on the GPU and readers apply on it)",
    )
    parser.add_argument(
        "--weights",
        choices=sorted(MODELS),
        default="smollm2",
        help="smollm2: the real model (cached here); random: its shapes with a seeded random init, "
        "for machines without the model file",
    )
    parser.add_argument(
        "--source",
        choices=["fp32", "bf16"],
        default="fp32",
        help="what the sweep publishes from: fp32 masters (a trainer) or bf16 tensors",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")

    def as_source(bits: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        made = (as_fp32 if args.source == "fp32" else as_tensors)(bits, shapes)
        return made if device.type == "cpu" else {n: t.to(device) for n, t in made.items()}

    torch.set_num_threads(args.threads)
    global WEIGHT_THREADS, WEIGHTS, DECODE_TRIES
    WEIGHT_THREADS, WEIGHTS = args.weight_threads, args.weights
    DECODE_TRIES = 1 if args.quick else args.decode_tries
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps = 0 if args.quick else args.steps
    reps = 1 if args.quick else args.reps
    t_start = time.perf_counter()

    import redis

    server = EmbeddedRedis(appendonly=False).start()
    client = redis.Redis.from_url(server.url)
    client.config_set("client-output-buffer-limit", "normal 0 0 0")
    try:
        log("loading SmolLM2-135M-Instruct (fp32, converted from the GGUF once and cached) ...")
        model = None if args.quick else load_model().to(device)
        named = (
            {n: t.to(device) for n, t in load_weights().items()} if model is None else dict(model.named_parameters())
        )
        numel = sum(p.numel() for p in named.values())
        log(f"  {len(named)} tensors, {numel / 1e6:.1f}M parameters, bf16 size {numel * 2 / 1e6:.0f} MB")
        shadows = [bf16_shadow(named) for _ in range(1 if args.quick else 5)]
        full = None
        if not args.quick:
            log("baseline (a): full safetensors sync through the same store ...")
            full = {
                1: measure_full(client, named, 1, shadows, tries=2),
                4: measure_full(client, named, 4, shadows, tries=2),
            }
            for n, f in full.items():
                log(
                    f"  full, {n} reader(s): publish {f['publish_s']:.2f}s, sync {f['sync_s']:.2f}s, "
                    f"{f['bytes'] / 1e6:.0f} MB"
                )
        rows: list[dict] = []
        full_bytes = None

        # 1. Real optimizer steps (fp32 masters, the trainer's path).
        if model is not None:
            keys = JobKeys("bench", "adamw")
            publisher = WeightPublisher(
                client, keys, rebase_interval=1000, rebase_fraction=4.0, chunk_bytes=CHUNK_BYTES, threads=WEIGHT_THREADS
            )
            full_bytes = publisher.publish(named).payload_bytes
            one, four = Readers(client, keys, shadows[:1]), Readers(client, keys, shadows[1:])
            one.sync()
            four.sync()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
            gen = torch.Generator().manual_seed(0)
            log(f"real steps: AdamW lr 1e-6, random-token LM loss, {steps} step(s)")
            for step in range(steps):
                base = {n: t.clone() for n, t in shadows[0].items()}
                ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen).to(device)
                started = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                log(f"  step {step}: {time.perf_counter() - started:.1f}s")
                truth = {n: bf16_bits(p) for n, p in named.items()}
                m = publish_and_sync(publisher, named, one, four, keys, client, base, truth)
                assert m["result"].kind == "delta", m["result"].reason
                rows.append(record("adamw-1e-6", f"step {step + 1}", m, numel, full_bytes, full, [m]))

        # 2. Synthetic density sweep on the model's bf16 values, published from fp32 (or bf16) tensors.
        sweep_names = list(named)
        if args.quick:  # a slice of the model keeps --quick under a minute
            budget, sweep_names = 0, []
            for name, p in named.items():
                if p.numel() > 4_000_000:  # the 28M-value embedding alone would take too long here
                    continue
                sweep_names.append(name)
                budget += p.numel()
                if budget > 8_000_000:
                    break
        shapes = {n: tuple(named[n].shape) for n in sweep_names}
        bits = {n: bf16_bits(named[n]).copy() for n in sweep_names}
        sweep_numel = sum(b.size for b in bits.values())
        log(
            f"synthetic sweep on {len(sweep_names)} tensors ({sweep_numel / 1e6:.1f}M values), "
            f"{reps} version(s) per density"
        )
        skeys = JobKeys("bench", "sweep")
        sub_shadows = [{n: s[n] for n in sweep_names} for s in shadows]
        while len(sub_shadows) < 5:  # --quick: extra readers only for the slice
            sub_shadows.append({n: shadows[0][n].clone() for n in sweep_names})
        spub = WeightPublisher(
            client, skeys, rebase_interval=1000, rebase_fraction=100.0, chunk_bytes=CHUNK_BYTES, threads=WEIGHT_THREADS
        )
        sfull = spub.publish(as_source(bits, shapes)).payload_bytes
        full_bytes = full_bytes or sfull
        sone, sfour = Readers(client, skeys, sub_shadows[:1]), Readers(client, skeys, sub_shadows[1:])
        sone.sync()
        sfour.sync()
        sub_full = full
        if args.quick:
            sub_full = {
                1: measure_full(client, as_source(bits, shapes), 1, sub_shadows, tries=2),
                4: measure_full(client, as_source(bits, shapes), 4, sub_shadows, tries=2),
            }
        rng = np.random.default_rng(0)
        for density in DENSITIES:
            tries = []
            for _ in range(reps):
                base = {n: t.clone() for n, t in sub_shadows[0].items()}
                bits = nudge(bits, density, rng)
                tries.append(publish_and_sync(spub, as_source(bits, shapes), sone, sfour, skeys, client, base, bits))
            m = tries[-1]
            rows.append(record("synthetic", f"{density * 100:g}%", m, sweep_numel, sfull, sub_full, tries))
    finally:
        client.close()
        server.close()

    def rows_at(lo: float, hi: float) -> list[dict]:
        return [r for r in rows if r["workload"] == "synthetic" and lo <= r["changed_fraction"] <= hi]

    at_half_to_one = rows_at(0.004, 0.011)
    at_one = rows_at(0.008, 0.011)
    real_rows = [r for r in rows if r["workload"] == "adamw-1e-6"]
    targets = {
        "lossless_every_version": all(r["lossless"] for r in rows),
        "no_reader_recovered_or_fell_back": all(r["clean_syncs"] for r in rows),
        "max_bytes_per_change_with_manifest_0.5_to_1pct": max(
            r["bytes_per_changed_value_with_manifest"] for r in at_half_to_one
        ),
        "max_bytes_per_change_0.5_to_1pct": max(r["bytes_per_changed_value"] for r in at_half_to_one),
        "bytes_per_change_target_2.5_met": all(r["bytes_per_changed_value"] <= 2.5 for r in at_half_to_one),
        "speedup_vs_full_at_1pct_1_reader": at_one[0]["speedup_1_reader"] if at_one else None,
        "speedup_vs_full_at_1pct_4_readers": at_one[0]["speedup_4_readers"] if at_one else None,
        "speedup_target_20x_met": bool(at_one) and at_one[0]["speedup_1_reader"] >= 20,
        "reader_side_speedup_at_1pct": at_one[0]["reader_speedup_1"] if at_one else None,
        "cpu_speedup_vs_full_at_1pct_1_reader": at_one[0]["cpu_speedup_1_reader"] if at_one else None,
        "decode_apply_gbps_by_row": {f"{r['workload']} {r['label']}": r["decode_apply_gbps"] for r in rows},
        "decode_apply_gbps_median_by_row": {
            f"{r['workload']} {r['label']}": r["decode_apply_gbps_median"] for r in rows
        },
        "min_decode_apply_gbps_0.5_to_1pct": min(r["decode_apply_gbps"] for r in at_half_to_one),
        "decode_apply_1gbps_met_0.5_to_1pct": all(r["decode_apply_gbps"] >= 1.0 for r in at_half_to_one),
        "decode_apply_1gbps_met_every_row": all(r["decode_apply_gbps"] >= 1.0 for r in rows),
        "decode_apply_cpu_gbps_by_row": {f"{r['workload']} {r['label']}": r["decode_apply_cpu_gbps"] for r in rows},
        "decode_apply_cpu_1gbps_met_0.5_to_1pct": all(r["decode_apply_cpu_gbps"] >= 1.0 for r in at_half_to_one),
        "real_step_changed_fraction": [r["changed_fraction"] for r in real_rows],
        "real_step_bytes_per_change": [r["bytes_per_changed_value"] for r in real_rows],
    }
    summary = {
        "benchmark": "weight_delta",
        "quick": args.quick,
        "model": MODELS[args.weights],
        "numel": numel,
        "sweep_numel": sweep_numel,
        "sweep_source": SOURCES[args.source],
        "full_bytes": full_bytes,
        "device": str(device),
        "threads": args.threads,
        "weight_threads": args.weight_threads,
        "reps": reps,
        "decode_tries": DECODE_TRIES,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "full_sync": full if full else sub_full,
        "rows": rows,
        "targets": targets,
        "seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out or ("docs/results/weight_delta_quick" if args.quick else "docs/results/weight_delta"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(rows, out.with_suffix(".png"))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
