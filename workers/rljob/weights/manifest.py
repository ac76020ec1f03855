"""The manifest of one published weight version: the only thing a reader trusts.

It is written after every chunk it names, in the same atomic step that moves `latest`, so a
version a reader can see is always complete. It crosses process boundaries, hence pydantic. There
is one format: a store lives and dies with one job's Redis, so trainer and rollout workers run the
same rljob, and a manifest of another format is refused with that advice (`store`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FORMAT = 6


class ChunkRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    length: int = Field(ge=0)
    crc: int = Field(ge=0, description="CRC32 of the chunk's bytes.")


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int]
    checksum: str = Field(
        "",
        description="SHA-256 prefix of the tensor's bf16 bytes in `check_range` after this version; "
        "empty when this version does not check the tensor by SHA-256.",
    )
    check_range: list[int] | None = Field(
        None, description="[start, stop) of the flat elements `checksum` covers; None: all of them."
    )
    changed: int = Field(0, ge=0, description="Values that differ from the base version.")


class DeltaStream(BaseModel):
    """`codec.EncodedDelta.meta()`: the change of all tensors laid end to end in manifest order."""

    model_config = ConfigDict(extra="forbid")

    numel: int = Field(ge=0)
    count: int = Field(ge=0)
    gap_width: Literal[1, 2, 4, 8]
    step_width: Literal[1, 2]
    lengths: list[int] = Field(description="Bytes of the gap stream and the step stream (none when nothing changed).")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal[6] = MANIFEST_FORMAT
    version: int = Field(ge=0)
    kind: Literal["full", "delta"]
    base_version: int | None = Field(None, description="Delta only: the version it applies to.")
    full_version: int = Field(ge=0, description="The full export this version's chain starts from.")
    chain_length: int = Field(0, ge=0, description="Deltas since that full, this one included.")
    chain_bytes: int = Field(0, ge=0, description="Payload bytes of those deltas.")
    full_bytes: int = Field(ge=0, description="Payload bytes of that full export.")
    payload_bytes: int = Field(ge=0)
    numel: int = Field(ge=0)
    changed: int = Field(0, ge=0)
    created_at: float
    publish_id: str = Field("", description="Random per publish: tells apart two versions of the same number.")
    base_publish_id: str = Field("", description="Delta only: the publish id of the version it applies to.")
    chunks: list[ChunkRef]
    tensors: list[TensorEntry]
    stream: DeltaStream | None = Field(None, description="Delta only: the coded change (`codec`).")
    change_sum: str | None = Field(
        None, description="Delta only: hex `checksum.change_sum` over `stream`'s positions (old -> new)."
    )
