"""The weight store's numpy kernels against the plain whole-array versions they replaced.

Each row times one kernel of the delta path and a straightforward reference computing the same
thing (checked equal first), on synthetic changes spread over 134.5M values (the size of
SmolLM2-135M) at 1% and 10% density, and prints reference / kernel side by side. The references
are what the store did before: whole-array expressions whose temporaries are model-sized, a
per-value comparison, the group-word path of the fixed-width bit packer (each field shifted
into or out of one word per group), which other widths still take, numpy's fancy indexing for
the reader's gather and scatter, the system zlib (Python's `zlib`) where zlib-ng now runs, and
numpy's apply of a whole stream where dense streams now take the compiled kernel (1%, 3%, 10%:
`weights/compiled_apply.py`, compiled before it is timed). Best of `--reps`, one thread.
Writes docs/results/weight_kernels.json.
  python benchmarks/bench_weight_kernels.py            # about a minute
  python benchmarks/bench_weight_kernels.py --quick    # a tenth of the values
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch
from _common import finish, progress

from rljob.weights import bitfields, changes, compiled_apply, encoding, intcodes
from rljob.weights.apply import apply_stream, gather_bits, scatter_bits
from rljob.weights.bitfields import field_type, pack_fixed, unpack_fixed
from rljob.weights.changes import find_changes
from rljob.weights.checksum import _MASK64, _VALUE_HASH, change_sum_of_parts, chunk_crc
from rljob.weights.encoding import from_ordered, to_ordered, ulp_unzigzag

_U64 = np.uint64


def change_sum_whole(positions, old, new, starts, offsets) -> int:
    """The change sum as whole-array expressions (the store's version before blocking)."""
    diff = _VALUE_HASH[new] - _VALUE_HASH[old]
    weighted = int(np.dot(diff, positions.view(_U64)))
    per_part = np.add.reduceat(diff, starts)
    shifts = offsets.astype(_U64) * _U64(2) + _U64(1)
    return (2 * weighted + int(np.dot(per_part, shifts))) & _MASK64


def zigzag_whole(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    step = to_ordered(new) - to_ordered(old)
    return ((step << 1) ^ (step >> 15)).view(np.uint16)


def unzigzag_whole(old: np.ndarray, zig: np.ndarray) -> np.ndarray:
    step = (zig >> 1).view(np.int16) ^ -(zig & 1).view(np.int16)
    return from_ordered(to_ordered(old) + step)


def rice_encode_whole(positions: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice-coded positions from an array of all gaps, with whole-array passes over int64."""
    gaps = intcodes.position_gaps(positions)
    terminators = gaps >> k
    terminators += 1
    np.cumsum(terminators, out=terminators)
    terminators -= 1
    bits = np.zeros(int(terminators[-1]) + 1, dtype=np.uint8)
    bits[terminators] = 1
    return np.packbits(bits).tobytes(), pack_fixed(gaps & ((1 << k) - 1), k)


def rice_decode_whole(unary: bytes, low: bytes, count: int, k: int) -> np.ndarray:
    """Rice-coded positions with the arithmetic after the unary stream as whole-array passes."""
    terminators = intcodes._terminators(unary, count)
    shifted = unpack_fixed(low, count, k, dtype=np.int8 if k <= 7 else np.int16 if k <= 15 else np.int32)
    shifted -= shifted.dtype.type((1 << k) - 1)
    total_type = np.int32 if count * ((1 << k) - 1) < 2**31 else np.int64
    terminators <<= k
    terminators += np.cumsum(shifted, dtype=total_type)
    terminators += (1 << k) - 1
    return terminators


def ef_unpack_whole(upper: bytes, lower: bytes, count: int, low_bits: int) -> np.ndarray:
    """Elias-Fano positions with a ramp the size of the changes subtracted in one pass."""
    positions = intcodes._terminators(upper, count)
    positions -= np.arange(count)
    positions <<= low_bits
    positions |= unpack_fixed(lower, count, low_bits, dtype=field_type(low_bits))
    return positions


def deflate_system_zlib(stream: bytes) -> bytes:
    """`encoding._maybe_zip`'s compression with Python's own zlib (the same settings)."""
    compressor = zlib.compressobj(encoding._ZLIB_LEVEL, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    return compressor.compress(stream) + compressor.flush()


def gather_fancy(memory: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """The reader's gather before: numpy fancy indexing, then a copy into the buffer."""
    out[:] = memory[positions]


def scatter_fancy(memory: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    memory[positions] = values


def find_per_value(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocked per-value comparison (one flag per value for numpy's nonzero), with the values at
    the changes gathered as `find_changes` does."""
    block, found = changes._COMPARE_BLOCK, []
    differ = np.empty(min(block, old.size), dtype=np.bool_)
    for start in range(0, old.size, block):
        stop = min(start + block, old.size)
        np.not_equal(old[start:stop], new[start:stop], out=differ[: stop - start])
        hit = np.flatnonzero(differ[: stop - start])
        found.append((hit + start, old[start:stop][hit], new[start:stop][hit]))
    positions, was, now = (np.concatenate(parts) for parts in zip(*found, strict=True))
    return positions, was, now


def best_of(reps: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


Row = Callable[..., None]  # (name, density, reference, kernel, **extra fields of the row)


def kernels_at(density: float, base: np.ndarray, rng: np.random.Generator, row: Row) -> None:
    """One row per kernel for changes at `density` of `base`, each checked against its reference."""
    changed = np.flatnonzero(rng.random(base.size) < density)
    new = base.copy()
    steps = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), changed.size)
    new[changed] = from_ordered(to_ordered(base[changed]) + steps)
    assert np.array_equal(find_per_value(base, new)[0], find_changes(base, new).positions)
    row("find changes (word compare)", density, lambda: find_per_value(base, new), lambda: find_changes(base, new))

    k = intcodes.best_rice_k_of_gaps(changed)
    assert rice_encode_whole(changed, k) == intcodes.rice_encode(changed, k)
    row("Rice positions encode (blocked)", density, lambda: rice_encode_whole(changed, k),
        lambda: intcodes.rice_encode(changed, k))  # fmt: skip
    rice = (*intcodes.rice_encode(changed, k), changed.size, k)
    assert np.array_equal(rice_decode_whole(*rice), changed) and np.array_equal(intcodes.rice_decode(*rice), changed)
    row("Rice positions decode (blocked)", density, lambda: rice_decode_whole(*rice),
        lambda: intcodes.rice_decode(*rice))  # fmt: skip
    ef = (*intcodes.ef_pack(changed, 8), changed.size, 8)
    assert np.array_equal(ef_unpack_whole(*ef), changed) and np.array_equal(intcodes.ef_unpack(*ef), changed)
    row("Elias-Fano positions decode (blocked)", density, lambda: ef_unpack_whole(*ef),
        lambda: intcodes.ef_unpack(*ef))  # fmt: skip

    old_v, new_v = base[changed], new[changed]
    starts = np.arange(0, changed.size, max(1, changed.size // 272), dtype=np.intp)
    sums = (changed, old_v, new_v, starts, np.zeros(starts.size, dtype=np.int64))
    assert change_sum_whole(*sums) == change_sum_of_parts(*sums)
    row("change sum (blocked)", density, lambda: change_sum_whole(*sums), lambda: change_sum_of_parts(*sums))

    zig = encoding.ulp_zigzag(old_v, new_v)
    assert np.array_equal(zigzag_whole(old_v, new_v), zig)
    row("ulp zig-zag (blocked)", density, lambda: zigzag_whole(old_v, new_v), lambda: encoding.ulp_zigzag(old_v, new_v))
    assert np.array_equal(unzigzag_whole(old_v, zig), ulp_unzigzag(old_v, zig))
    row("ulp un-zig-zag (blocked)", density, lambda: unzigzag_whole(old_v, zig), lambda: ulp_unzigzag(old_v, zig))

    for bits in bitfields._BYTE_ASSEMBLY_WIDTHS:
        fixed_width_rows(bits, rng.integers(0, 1 << bits, changed.size).astype(np.uint8), density, row)

    apply_rows(base, changed, new_v, density, row)
    # Value planes like the first real AdamW step's (ulp2+z): mostly 1-2 ulp, a few percent of
    # steps in the thousands (values near zero).
    wide = rng.random(changed.size) < 0.06
    planes = encoding._split_planes(np.where(wide, rng.integers(5, 30000, changed.size), zig).astype(np.uint16))
    packed, zipped = encoding._maybe_zip(planes)
    assert zipped and zlib.decompress(packed) == zlib.decompress(deflate_system_zlib(planes)) == planes
    row("deflate ulp planes (zlib-ng)", density, lambda: deflate_system_zlib(planes),
        lambda: encoding._maybe_zip(planes))  # fmt: skip
    assert encoding._unzip(packed, True, len(planes)) == zlib.decompress(packed) == planes
    row("inflate ulp planes (zlib-ng)", density, lambda: zlib.decompress(packed),
        lambda: encoding._unzip(packed, True, len(planes)))  # fmt: skip


def apply_rows(base: np.ndarray, changed: np.ndarray, new_v: np.ndarray, density: float, row: Row) -> None:
    """The reader's gather of the old values and scatter of the new ones, on a bf16 tensor."""
    tensor = torch.from_numpy(base.copy().view(np.int16)).view(torch.bfloat16)
    memory = tensor.view(torch.int16).numpy().view(np.uint16)
    reference, out = np.empty(changed.size, dtype=np.uint16), np.empty(changed.size, dtype=np.uint16)
    gather_fancy(memory, changed, reference)
    assert np.array_equal(gather_bits(tensor, changed, out=out), reference)
    row("gather old values (take)", density, lambda: gather_fancy(memory, changed, reference),
        lambda: gather_bits(tensor, changed, out=out))  # fmt: skip
    expected = base.copy()
    expected[changed] = new_v
    scatter_bits(tensor, changed, new_v)
    assert np.array_equal(memory, expected)  # both sides write the same values again from here on
    row("scatter new values (torch scatter_)", density, lambda: scatter_fancy(memory, changed, new_v),
        lambda: scatter_bits(tensor, changed, new_v))  # fmt: skip


def smollm2_sizes(numel: int) -> list[int]:
    """SmolLM2-135M's 272 tensor sizes (embedding, 30 layers of 9, final norm), scaled to `numel`."""
    hidden, kv, mlp = 576, 192, 1536
    layer = [hidden, hidden * hidden, kv * hidden, kv * hidden, hidden * hidden, mlp * hidden, mlp * hidden,
             hidden * mlp, hidden]  # fmt: skip
    sizes = [49152 * hidden] + layer * 30 + [hidden]
    scaled = [max(1, size * numel // sum(sizes)) for size in sizes]
    scaled[0] += numel - sum(scaled)
    return scaled


def compiled_apply_row(base: np.ndarray, density: float, rng: np.random.Generator, row: Row) -> None:
    """A whole stream's apply over SmolLM2's tensor layout: numpy's passes against the compiled
    kernel (`RLJOB_COMPILED_APPLY` off / on), checked bit-equal with equal change sums first."""
    changed = np.flatnonzero(rng.random(base.size) < density)
    new = base.copy()
    new[changed] = from_ordered(
        to_ordered(base[changed]) + rng.choice(np.array([-2, -1, 1, 2], np.int16), changed.size)
    )
    sizes = smollm2_sizes(base.size)
    cuts = np.cumsum([0, *sizes])
    olds = [base[a:b] for a, b in itertools.pairwise(cuts)]
    found = [find_changes(base[a:b], new[a:b]) for a, b in itertools.pairwise(cuts)]
    enc = encoding.encode_changes(*changes.merge_changes(found, sizes))

    def targets() -> list[torch.Tensor]:
        return [torch.from_numpy(o.copy().view(np.int16)).view(torch.bfloat16) for o in olds]

    def apply(tensors: list[torch.Tensor], mode: str) -> int:
        before = os.environ.get("RLJOB_COMPILED_APPLY")
        os.environ["RLJOB_COMPILED_APPLY"] = mode
        try:
            return apply_stream(tensors, sizes, enc)[0]
        finally:
            if before is None:
                os.environ.pop("RLJOB_COMPILED_APPLY")
            else:
                os.environ["RLJOB_COMPILED_APPLY"] = before

    checked = {"off": (apply(t := targets(), "off"), t)}
    started = time.perf_counter()
    checked["on"] = (apply(t := targets(), "on"), t)  # compiles here, on the first row
    first_call_s = time.perf_counter() - started
    assert checked["off"][0] == checked["on"][0] and compiled_apply._broken is None
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(checked["off"][1], checked["on"][1], strict=True)
    )
    off, on = targets(), targets()  # timed on these: every rep does the same work (values move on)
    # first_call_s: the kernel's first call of the process (the first row), compile and check
    # included; with TORCHINDUCTOR_CACHE_DIR pointing at an empty folder, a cold compile.
    row(f"apply stream ({enc.values}; compiled)", density, lambda: apply(off, "off"), lambda: apply(on, "on"),
        first_call_s=first_call_s)  # fmt: skip


def fixed_width_rows(bits: int, fields: np.ndarray, density: float, row: Row) -> None:
    packed = pack_fixed(fields, bits)
    assert bitfields._pack_group_words(fields, bits) == packed
    row(f"pack {bits}-bit fields (byte assembly)", density,
        lambda: bitfields._pack_group_words(fields, bits), lambda: pack_fixed(fields, bits))  # fmt: skip
    if bits not in bitfields._CHUNK_TABLES:
        return
    raw = np.frombuffer(packed, dtype=np.uint8)
    unpacked = unpack_fixed(packed, fields.size, bits, dtype=np.uint8)
    assert np.array_equal(bitfields._unpack_group_words(raw, fields.size, bits, np.uint8), unpacked)
    row(f"unpack {bits}-bit fields (chunk tables)", density,
        lambda: bitfields._unpack_group_words(raw, fields.size, bits, np.uint8),
        lambda: unpack_fixed(packed, fields.size, bits, dtype=np.uint8))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="13.5M values instead of 134.5M")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", default=None, help="folder for weight_kernels.json (default docs/results)")
    args = parser.parse_args()
    numel = 134_515_008 // (10 if args.quick else 1)
    rng = np.random.default_rng(0)
    base = (rng.normal(0.0, 0.02, numel).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    rows = []

    def row(name: str, density: float, reference: Callable[[], object], kernel: Callable[[], object],
            **extra: float) -> None:  # fmt: skip
        ref_s, new_s = best_of(args.reps, reference), best_of(args.reps, kernel)
        rows.append({"kernel": name, "density": density, "reference_s": ref_s, "kernel_s": new_s,
                     "speedup": ref_s / new_s, **extra})  # fmt: skip
        progress(f"{density * 100:g}% {name:<34} reference {ref_s * 1e3:7.1f} ms  kernel {new_s * 1e3:7.1f} ms  "
                 f"x{ref_s / new_s:.2f}" + "".join(f"  {k} {v:.2f}" for k, v in extra.items()))  # fmt: skip

    for density in (0.01, 0.1):
        kernels_at(density, base, rng, row)
    for density in (0.01, 0.03, 0.1):
        compiled_apply_row(base, density, rng, row)
    chunks = [base[a : a + (1 << 21)].data for a in range(0, base.size, 1 << 21)]  # 4 MB, as the store's
    assert [chunk_crc(c) for c in chunks] == [zlib.crc32(c) for c in chunks]
    row("chunk CRC32, whole model (zlib-ng)", 1.0, lambda: [zlib.crc32(c) for c in chunks],
        lambda: [chunk_crc(c) for c in chunks])  # fmt: skip
    finish("weight_kernels", {"numel": numel, "reps": args.reps, "rows": rows}, args.results)


if __name__ == "__main__":
    main()
