"""The reader's apply of a dense delta as one compiled kernel per tensor (`torch.compile`; on the
CPU, inductor's generated C++).

Why: numpy's apply (`apply.apply_stream`) makes its passes over the changes one after another,
each through memory: gather the old patterns, un-zig-zag the ulp steps, scatter the new patterns,
two table lookups and a weighted sum for the change sum. The kernel reads each change once and
does all of it there. Over SmolLM2's 272 tensors on one thread (`benchmarks/bench_weight_kernels.py`,
"apply stream" rows, numpy time / compiled time, three runs): 1.18-2.10x at 10% density,
0.93-1.10x at 3%, 0.57-0.75x at 1%: at low density its 272 calls and scattered reads lose to
numpy's take and scatter, so it is used from `MIN_DENSITY` up.

The kernel computes exactly what numpy's path does: the same patterns land in the tensor and the
same change sum comes back (`checksum.change_sum`, int64 arithmetic wrapping mod 2^64).

Compiling needs a C++ compiler and takes seconds (`bench_weight_kernels.py --quick`, its first
"apply stream" row's `first_call_s`: 20.5 s here with an empty TORCHINDUCTOR_CACHE_DIR, 4.0 s with
a warm one), so every variant a stream needs (target dtype, value coding) is compiled and
checked against numpy on a small case before it touches a target; when that fails (no compiler in
the image, say) a warning is logged once and numpy's path stays in use. RLJOB_COMPILED_APPLY:
``auto`` (the default): the first dense stream starts the compile in a background thread and is
applied by numpy, as is every stream until the kernel is ready, so a reader's sync never waits
for a compiler; ``on``: at any density, compiling in the caller's thread when needed (tests and
benchmarks, which time the kernel, not the compile); ``off``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rljob.weights.checksum import _VALUE_HASH, change_sum
from rljob.weights.encoding import patterns_from_codes

log = logging.getLogger(__name__)

MIN_DENSITY = 0.05
# Parts (one tensor's changes) this small take numpy's path: a compiled call costs tens of
# microseconds, and sizes 0 and 1 would each compile a graph of their own (torch's 0/1
# specialisation).
MIN_PART = 64
_TABLE = torch.from_numpy(_VALUE_HASH.view(np.int64).copy())
_MODES = ("auto", "on", "off")


def _kernel(
    memory: torch.Tensor, positions: torch.Tensor, offset: torch.Tensor, codes: torch.Tensor, steps: bool
) -> torch.Tensor:
    """Apply one tensor's changes in place and return their change sum (int64, wrapping).

    `memory` is the target's int16 view (bf16) or int32 view (fp32, the pattern in the upper
    half); `positions` are stream-wide, `offset` the tensor's start in the stream; `codes` are
    zig-zag ulp steps (`steps`) or the new patterns.
    """
    index = positions - offset
    wide = memory.dtype == torch.int32
    old = memory[index] >> 16 if wide else memory[index].to(torch.int32)  # sign-extended pattern
    if steps:
        ordered = old ^ ((old >> 15) & 0x7FFF)  # encoding.to_ordered
        zig = codes.to(torch.int32) & 0xFFFF
        moved = ordered + ((zig >> 1) ^ -(zig & 1))
        moved = ((moved + 32768) & 0xFFFF) - 32768  # wraps mod 2^16, as int16 arithmetic does
        new = moved ^ ((moved >> 15) & 0x7FFF)  # encoding.from_ordered
    else:
        new = codes.to(torch.int32)
    memory.index_put_((index,), new << 16 if wide else new.to(torch.int16))
    diff = _TABLE[new & 0xFFFF] - _TABLE[old & 0xFFFF]
    return (diff * (2 * positions + 1)).sum()


_compiled: Callable[..., torch.Tensor] | None = None  # made on first use: importing dynamo takes seconds
_lock = threading.Lock()
_lock_warming = threading.Lock()
_ready: set[tuple[torch.dtype, torch.dtype, bool]] = set()
_broken: str | None = None  # why the compiled path is off for this process
_warming: dict[tuple[torch.dtype, torch.dtype, bool], threading.Thread] = {}  # background compiles


def _compiled_kernel() -> Callable[..., torch.Tensor]:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_kernel, dynamic=True)
    return _compiled


def mode() -> str:
    value = os.environ.get("RLJOB_COMPILED_APPLY", "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"RLJOB_COMPILED_APPLY must be one of {_MODES}, got {value!r}")
    return value


def wanted(count: int, numel: int) -> bool:
    """Whether a stream of `count` changes over `numel` elements should take the compiled kernel."""
    chosen = mode()
    if chosen == "off" or _broken is not None or count == 0:
        return False
    return chosen == "on" or count >= MIN_DENSITY * numel


def _memory(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat.view(torch.int32)


def _reference(memory: np.ndarray, positions: np.ndarray, offset: int, codes: np.ndarray, steps: bool) -> int:
    """numpy's apply of the same changes, for the check of a freshly compiled variant."""
    wide = memory.dtype == np.int32
    index = positions - offset
    old = (memory[index] >> 16).astype(np.uint16) if wide else memory[index].view(np.uint16)
    new = patterns_from_codes(steps, codes, old)
    memory[index] = new.view(np.int16).astype(np.int32) << 16 if wide else new.view(np.int16)
    return change_sum(index, old, new, offset)


def _prepare(variant: tuple[torch.dtype, torch.dtype, bool]) -> bool:
    """Compile `variant` and check it against numpy on a small case, before any target is touched.
    False (and numpy's path from then on, with one warning) when that fails."""
    global _broken
    if variant in _ready:
        return True
    with _lock:
        if variant in _ready or _broken is not None:
            return _broken is None
        memory_dtype, codes_dtype, steps = variant
        rng = np.random.default_rng(0)
        wide = memory_dtype == torch.int32
        bits = rng.integers(0, 1 << 16, 256, dtype=np.uint16)  # every kind of pattern: NaN, inf, -0
        memory = (bits.view(np.int16).astype(np.int32) << 16) if wide else bits.view(np.int16).copy()
        positions = np.sort(rng.choice(np.arange(100, 356), 96, replace=False)).astype(np.int64)
        high = 256 if codes_dtype == torch.uint8 else 1 << 16
        codes = rng.integers(0, high, positions.size).astype(np.uint8 if codes_dtype == torch.uint8 else np.uint16)
        expected = memory.copy()
        expected_sum = _reference(expected, positions, 100, codes, steps)
        try:
            target = torch.from_numpy(memory)
            got = _compiled_kernel()(
                target,
                torch.from_numpy(positions),
                torch.tensor(100),
                torch.from_numpy(codes if codes.dtype == np.uint8 else codes.view(np.int16)),
                steps,
            )
            if not np.array_equal(target.numpy(), expected) or int(got) & (2**64 - 1) != expected_sum:
                raise RuntimeError("the compiled kernel disagrees with numpy on a check case")
        except Exception as exc:  # no C++ compiler, an inductor error, a wrong result: numpy's path
            _broken = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("compiled weight apply unavailable, numpy's path is used instead: %s", _broken)
            return False
        _ready.add(variant)
        return True


def _ready_for(variants: set[tuple[torch.dtype, torch.dtype, bool]], *, wait: bool) -> bool:
    """Whether every variant is compiled and checked. With `wait`, compile what is missing here;
    without, start compiling it in the background and answer False until it is done."""
    missing = [variant for variant in variants if variant not in _ready]
    if not missing:
        return True
    if wait:
        return all(_prepare(variant) for variant in missing)
    for variant in missing:
        with _lock_warming:
            if variant not in _warming and _broken is None:
                log.info("compiling the weight apply kernel for %s in the background; numpy applies meanwhile", variant)
                _warming[variant] = thread = threading.Thread(
                    target=_prepare, args=(variant,), name="rljob-compile-apply", daemon=True
                )
                thread.start()
    return False


def wait_until_compiled(timeout: float | None = None) -> bool:
    """Join the background compiles started so far; True when the compiled path is usable."""
    for thread in list(_warming.values()):
        thread.join(timeout)
    return _broken is None and all(variant in _ready for variant in _warming)


def apply_parts(
    flats: dict[int, torch.Tensor],
    parts: Sequence[tuple[int, int, int]],
    positions: np.ndarray,
    offsets: np.ndarray,
    codes: np.ndarray,
    steps: bool,
) -> int | None:
    """Apply a stream's changes, part by part (tensor i takes positions[a:b], stream-wide), into
    the CPU tensors `flats[i]` (flat views); return the change sum. None, with nothing touched,
    when a variant the stream needs is not compiled yet (``auto``: it is being compiled in the
    background) or cannot be."""
    codes_dtype = torch.uint8 if codes.dtype == np.uint8 else torch.int16
    variants = {(_memory(flats[i]).dtype, codes_dtype, steps) for i, a, b in parts if b - a >= MIN_PART}
    wait = mode() == "on"
    if not _ready_for(variants, wait=wait) or (not wait and _lock.locked()):
        # The second clause: another variant compiling in the background. Dynamo compiling in one
        # thread while another runs its code is a combination nothing here tests; numpy applies.
        return None
    if not codes.flags.writeable:  # a view of the payload; torch wants writable memory even to read
        codes = codes.copy()
    codes_t = torch.from_numpy(codes if codes.dtype == np.uint8 else codes.view(np.int16))
    positions_t, kernel = torch.from_numpy(positions), _compiled_kernel()
    total = 0
    with torch.no_grad():
        for i, a, b in parts:
            memory = _memory(flats[i])
            offset = int(offsets[i])
            if b - a >= MIN_PART:
                total += int(kernel(memory, positions_t[a:b], torch.tensor(offset), codes_t[a:b], steps))
            else:
                total += _reference(memory.numpy(), positions[a:b], offset, codes[a:b], steps)
    return total & (2**64 - 1)
