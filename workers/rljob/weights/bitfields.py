"""Fixed-width bit fields: non-negative integers packed as consecutive big-endian fields.

The building block of every packed stream of a delta (Rice remainders, Elias-Fano low parts,
fixed-width ulp steps). Vectorised per width class: whole bytes are a cast; 1, 2 and 4 bits
unpack by a byte-table lookup; 3 and 6 bits by 12-bit chunk tables; 3, 5, 6 and 7 bits pack byte
by byte; other widths that fill whole bytes in a group go through one word per group; the rest
through 64-bit words.
"""

from __future__ import annotations

import math

import numpy as np

from rljob.weights.errors import DeltaFormatError

_U64 = np.uint64


def _group(bits: int) -> int:
    """Fields per whole-byte group (g * bits is a multiple of 8), or 0 when a group overflows 64 bits."""
    g = 8 // math.gcd(bits, 8)
    return g if g * bits <= 64 else 0


def fast_width(bits: int) -> bool:
    """Widths `pack_fixed` handles a whole group at a time (all <= 8, even <= 16, multiples of 4)."""
    return bits == 0 or (bits <= 32 and _group(bits) > 0)


FAST_WIDTHS = tuple(k for k in range(32) if fast_width(k))


WORD_TYPES = {8: ">u1", 16: ">u2", 32: ">u4", 64: ">u8"}


def _word_type(group_bits: int) -> tuple[str, int]:
    """The narrowest big-endian integer that holds a group, and its size in bits."""
    size = next(size for size in (8, 16, 32, 64) if group_bits <= size)
    return WORD_TYPES[size], size


def pack_fixed(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative integers (< 2**bits, bits <= 32) as consecutive big-endian bit fields."""
    if bits == 0 or values.size == 0:
        return b""
    if not 0 < bits <= 32:
        raise ValueError(f"field width must be 1..32 bits, got {bits}")
    group = _group(bits)
    if not group:
        return _pack_fixed_words(values, bits)
    if bits in _BYTE_ASSEMBLY_WIDTHS:
        return _pack_by_bytes(values, bits)
    word_type, word_bits = _word_type(group * bits)
    if group == 1 and word_bits == bits:  # whole bytes: a plain cast
        return values.astype(word_type).tobytes()
    return _pack_group_words(values, bits)


def _pack_group_words(values: np.ndarray, bits: int) -> bytes:
    """`group` fields fill exactly group*bits/8 bytes: build each group's bits in one word."""
    group = _group(bits)
    word_type, word_bits = _word_type(group * bits)
    n = values.size
    rows = -(-n // group)
    native = np.dtype(word_type).newbyteorder("=")
    padded = np.zeros(rows * group, dtype=native)
    padded[:n] = values
    cols = padded.reshape(rows, group)
    word = cols[:, 0] << native.type(bits * (group - 1))
    for j in range(1, group):
        word |= cols[:, j] << native.type(bits * (group - 1 - j))
    width = group * bits // 8
    grid = word.astype(word_type).view(np.uint8).reshape(rows, word_bits // 8)[:, word_bits // 8 - width :]
    return grid.tobytes()[: (n * bits + 7) // 8]


def _pack_by_bytes(values: np.ndarray, bits: int) -> bytes:
    """Widths 3, 5, 6 and 7 (groups of 3, 5, 3 or 7 bytes): each byte of a group ORed together
    from the two or three fields that overlap it, on narrow columns (1.5-4.3x `_pack_group_words`,
    which shifts every field into a 32- or 64-bit word and byte-swaps it:
    benchmarks/bench_weight_kernels.py)."""
    n, group = values.size, _group(bits)
    width, rows = group * bits // 8, -(-n // group)
    fields = np.zeros(rows * group, dtype=np.uint16)
    fields[:n] = values
    columns = fields.reshape(rows, group)
    grid = np.empty((rows, width), dtype=np.uint8)
    byte, part = np.empty(rows, dtype=np.uint16), np.empty(rows, dtype=np.uint16)
    for j in range(width):
        byte[:] = 0
        for f in range(group):
            first, end = f * bits, (f + 1) * bits  # the field's bits within the group, first bit first
            if end <= 8 * j or first >= 8 * (j + 1):
                continue
            shift = 8 * (j + 1) - end  # moves the field's last bit to its place in byte j
            if shift >= 0:
                np.left_shift(columns[:, f], shift, out=part)
            else:
                np.right_shift(columns[:, f], -shift, out=part)
            byte |= part
        np.copyto(grid[:, j], byte, casting="unsafe")  # the low 8 bits
    return grid.tobytes()[: (n * bits + 7) // 8]


def _pack_fixed_words(values: np.ndarray, bits: int) -> bytes:
    """Any width <= 32: each field lands in at most two 64-bit words; OR them per word."""
    n = values.size
    x = values.astype(_U64) << _U64(64 - bits)  # field at the top of a word
    start = np.arange(0, n * bits, bits, dtype=_U64)
    word = start >> _U64(6)
    offset = start & _U64(63)
    head = x >> offset
    tail = (x << _U64(1)) << (_U64(63) - offset)  # what spilled past the word's end (0 if nothing)
    firsts = np.flatnonzero(np.diff(word, prepend=_U64(2**63)))
    used = word[firsts].astype(np.intp)
    words = np.zeros(int(used[-1]) + 2, dtype=_U64)
    words[used] = np.bitwise_or.reduceat(head, firsts)
    words[used + 1] |= np.bitwise_or.reduceat(tail, firsts)
    return words.astype(">u8").tobytes()[: (n * bits + 7) // 8]


def unpack_fixed(buf: bytes, count: int, bits: int, dtype: type = np.int64) -> np.ndarray:
    """Inverse of `pack_fixed`; returns int64 (or `dtype`, which must hold `bits` bits)."""
    if bits == 0 or count == 0:
        return np.zeros(count, dtype=dtype)
    if not 0 < bits <= 32:
        raise DeltaFormatError(f"field width must be 1..32 bits, got {bits}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size * 8 < count * bits:
        raise DeltaFormatError(f"fixed-width stream too short: {raw.size} bytes for {count}x{bits} bits")
    if bits in _BYTE_TABLES:  # 1, 2 or 4 bits: one table lookup per byte, all its fields as one word
        fields = _BYTE_TABLES[bits][raw[: (count * bits + 7) // 8]].view(np.uint8)[:count]
        return fields.astype(dtype)
    if bits in _CHUNK_TABLES:
        return _unpack_by_chunks(raw, count, bits).astype(dtype, copy=False)
    group = _group(bits)
    if not group:
        return _unpack_fixed_words(raw, count, bits).astype(dtype, copy=False)
    word_type, word_bits = _word_type(group * bits)
    if group == 1 and word_bits == bits:
        return np.frombuffer(buf, dtype=word_type, count=count).astype(dtype)
    return _unpack_group_words(raw, count, bits, dtype)


def _unpack_group_words(raw: np.ndarray, count: int, bits: int, dtype: type) -> np.ndarray:
    """Inverse of `_pack_group_words`: each group's bytes as one word, then each field shifted out."""
    group = _group(bits)
    word_type, word_bits = _word_type(group * bits)
    width, word_bytes = group * bits // 8, word_bits // 8
    rows = -(-count // group)
    grid = np.zeros((rows, word_bytes), dtype=np.uint8)
    flat = np.zeros(rows * width, dtype=np.uint8)
    used = min(raw.size, flat.size)
    flat[:used] = raw[:used]
    grid[:, word_bytes - width :] = flat.reshape(rows, width)
    native = np.dtype(word_type).newbyteorder("=")
    word = grid.view(word_type).reshape(rows).astype(native)
    out = np.empty((rows, group), dtype=dtype)
    mask = native.type((1 << bits) - 1)
    for j in range(group):
        out[:, j] = (word >> native.type(bits * (group - 1 - j))) & mask
    return out.reshape(-1)[:count]


def _byte_table(bits: int) -> np.ndarray:
    """Entry b: the 8 / bits fields of byte value b (first field in the high bits) as one byte
    each, packed into one 2-, 4- or 8-byte word, so a lookup is a flat gather (a gather of 2-D rows
    is about 5x slower in numpy)."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte - 1, -1, -1, dtype=np.uint8) * np.uint8(bits)
    rows = (np.arange(256, dtype=np.uint8)[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    table = np.ascontiguousarray(rows).view(f"u{per_byte}").reshape(256)
    table.setflags(write=False)
    return table


_BYTE_TABLES = {bits: _byte_table(bits) for bits in (1, 2, 4)}


def _chunk_table(bits: int, per: int) -> np.ndarray:
    """Entry c: the `per` fields of the (per * bits)-bit chunk c, one byte each, as one word."""
    shifts = np.arange(per - 1, -1, -1, dtype=np.uint32) * np.uint32(bits)
    rows = (np.arange(1 << (per * bits), dtype=np.uint32)[:, None] >> shifts) & np.uint32((1 << bits) - 1)
    table = np.ascontiguousarray(rows.astype(np.uint8)).view(f"u{per}").reshape(-1)
    table.setflags(write=False)
    return table


# Widths 3 and 6 (a group of fields is 3 bytes): looked up four or two fields at a time from the
# group's two 12-bit halves (tables of 4096 entries). 1.7-2.1x (3 bits; Rice remainders at 3-10%
# density) and 1.2-2.3x (6 bits) faster than shifting each field out of a group word
# (benchmarks/bench_weight_kernels.py); 5- and 7-bit chunks gained nothing, so those widths do not.
_CHUNK_TABLES = {bits: (per, _chunk_table(bits, per)) for bits, per in ((3, 4), (6, 2))}
# Widths whose groups `_pack_by_bytes` assembles byte by byte.
_BYTE_ASSEMBLY_WIDTHS = (3, 5, 6, 7)


def _unpack_by_chunks(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    """uint8 fields of a `_CHUNK_TABLES` width: chunk indices built from the group's bytes (each
    chunk spans two or three of them), then one table gather per chunk."""
    per, table = _CHUNK_TABLES[bits]
    group = _group(bits)
    width, chunks, chunk_bits = group * bits // 8, group // per, per * bits
    rows = -(-count // group)
    if raw.size >= rows * width:
        grid = raw[: rows * width].reshape(rows, width)
    else:
        grid = np.zeros(rows * width, dtype=np.uint8)
        grid[: raw.size] = raw
        grid = grid.reshape(rows, width)
    out = np.empty((rows, chunks), dtype=table.dtype)
    index = np.empty(rows, dtype=np.uint32)
    for j in range(chunks):
        first, last = j * chunk_bits // 8, ((j + 1) * chunk_bits - 1) // 8
        np.copyto(index, grid[:, first], casting="unsafe")
        for b in range(first + 1, last + 1):
            index <<= np.uint32(8)
            index |= grid[:, b]
        index >>= np.uint32(8 * (last + 1) - (j + 1) * chunk_bits)
        index &= np.uint32((1 << chunk_bits) - 1)
        np.take(table, index, out=out[:, j])
    return out.view(np.uint8).reshape(-1)[:count]


def _unpack_fixed_words(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    padded = np.zeros(((raw.size + 7) // 8 + 1) * 8, dtype=np.uint8)
    padded[: raw.size] = raw
    words = padded.view(">u8").astype(_U64)
    start = np.arange(0, count * bits, bits, dtype=_U64)
    word = (start >> _U64(6)).astype(np.intp)
    offset = start & _U64(63)
    # (next >> 1) >> (63 - offset) is next >> (64 - offset), and 0 when offset is 0.
    both = (words[word] << offset) | ((words[word + 1] >> _U64(1)) >> (_U64(63) - offset))
    return (both >> _U64(64 - bits)).astype(np.int64)


def field_type(bits: int) -> type:
    """The narrowest unsigned integer holding `bits`-bit fields (narrow outputs unpack faster)."""
    return np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32
