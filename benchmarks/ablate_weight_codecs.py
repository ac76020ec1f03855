"""Ablation of the weight-delta codings: what each position x value coding costs on real deltas.

Run on the revision that still has every coding (the redesign of issue #24 keeps one); the table
it writes is the evidence for what stayed. Per change density of SmolLM2-135M's bf16 values
(the sweep of `bench_weight_delta.py`: each changed value moved by 1-2 ulp) and per AdamW step
(lr 1e-6, fp32 masters, random-token loss): bytes per changed value, encode and decode times
(one thread, best of 3) of one stream over the whole model, for every forced coding, for the
automatic choice, and for the candidate `gaps+steps/zlib` (gaps and zig-zag ulp steps as byte
planes of the smallest width, each deflated with zlib's run-length strategy).
  python benchmarks/ablate_weight_codecs.py --out docs/results/weight_codec_ablation
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import bench_weight_delta as bench
import numpy as np
import torch
from _common import finish, progress
from zlib_ng import zlib_ng

from rljob.weights.changes import Changes, find_changes, merge_changes
from rljob.weights.checksum import bf16_bits
from rljob.weights.encoding import decode_positions, decode_value_codes, encode_changes, ulp_unzigzag, ulp_zigzag

POSITIONS = ("ef", "rice", "bitmask")
VALUES = ("raw", "ulp", "ulpf", "ulpr")


def best_of(fn: Callable[[], object], tries: int = 3) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(tries):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def planes(values: np.ndarray, width: int) -> bytes:
    return values.astype(f"<u{width}").view(np.uint8).reshape(-1, width).T.tobytes()


def unplanes(buf: bytes, count: int, width: int) -> np.ndarray:
    plane = np.frombuffer(buf, np.uint8).reshape(width, count)
    out = plane[0].astype(np.int64)
    for i in range(1, width):
        out |= plane[i].astype(np.int64) << (8 * i)
    return out


def deflate(buf: bytes) -> bytes:
    packer = zlib_ng.compressobj(1, zlib_ng.DEFLATED, 15, 9, zlib_ng.Z_RLE)
    return packer.compress(buf) + packer.flush()


def width_of(top: int) -> int:
    return 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4


def candidate(changes: Changes) -> dict:
    """gaps+steps/zlib: encode, decode, check, and time it."""

    def encode() -> tuple[bytes, bytes, int, int]:
        gaps = np.diff(changes.positions, prepend=-1) - 1
        steps = ulp_zigzag(changes.old, changes.new) - np.uint16(1)
        gw, sw = width_of(int(gaps.max())), width_of(int(steps.max()))
        return deflate(planes(gaps, gw)), deflate(planes(steps, sw)), gw, sw

    encode_s, (gz, sz, gw, sw) = best_of(encode)

    def decode() -> tuple[np.ndarray, np.ndarray]:
        positions = unplanes(zlib_ng.decompress(gz), changes.count, gw)
        positions += 1
        np.cumsum(positions, out=positions)
        positions -= 1
        steps = unplanes(zlib_ng.decompress(sz), changes.count, sw).astype(np.uint16) + np.uint16(1)
        return positions, ulp_unzigzag(changes.old, steps)

    decode_s, (positions, new) = best_of(decode)
    assert np.array_equal(positions, changes.positions) and np.array_equal(new, changes.new)
    return {"coding": "gaps+steps/zlib", "bytes": len(gz) + len(sz), "encode_s": encode_s, "decode_s": decode_s}


def existing(changes: Changes, numel: int, positions: str | None, values: str | None) -> dict:
    encode_s, enc = best_of(lambda: encode_changes(changes, numel, positions=positions, values=values))

    def decode() -> tuple[np.ndarray, np.ndarray]:
        where = decode_positions(enc)
        steps, codes = decode_value_codes(enc)
        return where, ulp_unzigzag(changes.old, codes) if steps else codes

    decode_s, (where, new) = best_of(decode)
    assert np.array_equal(where, changes.positions) and np.array_equal(new, changes.new)
    name = "auto: " + enc.encoding if positions is None else f"{positions}+{values}"
    return {"coding": name, "bytes": enc.nbytes, "encode_s": encode_s, "decode_s": decode_s}


def rows_for(label: str, changes: Changes, numel: int) -> list[dict]:
    rows = [existing(changes, numel, None, None), candidate(changes)]
    for p in POSITIONS:
        for v in VALUES:
            rows.append(existing(changes, numel, p, v))
    for row in rows:
        row.update(workload=label, density=changes.count / numel, changed=changes.count,
                   bytes_per_changed_value=row["bytes"] / changes.count)  # fmt: skip
        progress(f"{label:>14} {row['coding']:>22}: {row['bytes_per_changed_value']:.3f} B/change, "
                 f"encode {row['encode_s'] * 1e3:7.1f} ms, decode {row['decode_s'] * 1e3:7.1f} ms")  # fmt: skip
    return rows


def merged(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> tuple[Changes, int]:
    names = list(old)
    return merge_changes([find_changes(old[n], new[n]) for n in names], [old[n].size for n in names])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/weight_codec_ablation")
    parser.add_argument("--densities", default="0.005,0.01,0.03,0.1")
    parser.add_argument("--adamw-steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = bench.load_weights()
    base = {name: bf16_bits(t).copy() for name, t in weights.items()}
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    for density in (float(d) for d in args.densities.split(",")):
        rows += rows_for(f"sweep {density:.1%}", *merged(base, bench.nudge(base, density, rng)))
    if args.adamw_steps:
        model = bench.load_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        gen = torch.Generator().manual_seed(0)
        before = {n: bf16_bits(p).copy() for n, p in model.named_parameters()}
        for step in range(args.adamw_steps):
            ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after = {n: bf16_bits(p).copy() for n, p in model.named_parameters()}
            rows += rows_for(f"AdamW step {step + 1}", *merged(before, after))
            before = after
    finish(args.out.rsplit("/", 1)[-1], {"rows": rows}, results=args.out.rsplit("/", 1)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
