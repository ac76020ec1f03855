"""Checksums: of a tensor's bf16 bit pattern (what the reader must end up with) and of a chunk.

A tensor checksum is SHA-256 (hardware-accelerated on current CPUs, about as fast as CRC32 here)
over the little-endian bf16 bytes, so fp32 and bf16 copies of the same bf16 values agree. Chunks
carry a CRC32, enough to catch a torn or corrupted Redis value before anything is decoded.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import torch


def bf16_bits(tensor: torch.Tensor, *, exact: bool = False) -> np.ndarray:
    """The tensor's values as bf16 bit patterns (flat uint16 numpy; a view for CPU bf16 tensors).

    fp32 is rounded to nearest-even (what the trainer publishes from its fp32 masters). With
    `exact`, fp32 that holds bf16 values (a reader's target) is truncated instead, which keeps every
    pattern, NaN payloads included, where rounding would canonicalise NaNs.
    """
    t = tensor.detach()
    if exact and t.dtype == torch.float32:
        t = (t.contiguous().view(torch.int32) >> 16).to(torch.int16)
    elif t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    t = t.cpu().contiguous().reshape(-1)
    return t.view(torch.int16).numpy().view(np.uint16)


def bits_checksum(bits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(bits).astype("<u2", copy=False).data).hexdigest()[:32]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Checksum of the bf16 bit pattern a reader's tensor holds (fp32 targets: exact upper halves)."""
    return bits_checksum(bf16_bits(tensor, exact=True))


def chunk_crc(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF
