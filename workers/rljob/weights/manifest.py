"""The manifest of one published weight version: the only thing a reader trusts.

It is written after every chunk it names, in the same atomic step that moves `latest`, so a
version a reader can see is always complete. It crosses process boundaries, hence pydantic.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# 5: `base_publish_id`, a delta's base by identity, not by number alone: after Redis loses its last
#    commit and a restarted trainer publishes that number again, neither a reader holding the lost
#    version nor the old trainer (still alive, publishing on it) may build on it. Formats 1-4 read
#    as "" (not checked).
# 4: `publish_id`, a random id per publish: after Redis loses its last commit (AOF fsyncs every
#    second) and a restarted trainer publishes the same number again, a reader that held the lost
#    version can tell it is not the stored one. Formats 1-3 read as publish id "".
# 3: a delta is one encoded stream over all tensors laid end to end in manifest order (`stream`,
#    with one `change_sum`), instead of one stream per tensor: a version costs a few numpy calls
#    per tensor rather than a hundred. A publisher with coding "tensor" still writes one stream
#    per tensor (`stream` None, per-entry `encoding` and `change_sum`, as format 2).
# 2: deltas carry `change_sum` and SHA-256 only over a rotating `check_range` (format 1: whole
#    tensors, every version). A reader of format 3 reads formats 1 and 2 too.
MANIFEST_FORMAT = 5


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
    change_sum: str | None = Field(
        None, description="Delta only: hex `checksum.change_sum` of the changed values (old -> new)."
    )
    offset: int = Field(0, ge=0, description="Delta only: where this tensor's encoded bytes start.")
    length: int = Field(0, ge=0, description="Delta only: how many encoded bytes it has.")
    changed: int = Field(0, ge=0, description="Values that differ from the base version.")
    encoding: dict[str, Any] | None = Field(None, description="Delta only: `EncodedDelta.meta()`.")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = MANIFEST_FORMAT
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
    stream: dict[str, Any] | None = Field(
        None,
        description="Format-3 delta: `EncodedDelta.meta()` of the changes of all tensors laid end to end in "
        "`tensors` order (positions count from the first element of the first tensor).",
    )
    change_sum: str | None = Field(
        None, description="Format-3 delta: hex `checksum.change_sum` over `stream`'s positions (old -> new)."
    )

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        return cls.model_validate_json(raw)
