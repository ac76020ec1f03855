"""Weight store: trainer publishes bf16 versions (full or delta) to Redis, rollout workers sync.

See `publisher` (trainer side), `reader` (rollout side), `changes` (finding what changed),
`codec` (the one delta coding), `checksum`, `apply` (in-place writes), `store` (Redis layout and
commit protocol), `manifest` (what a version is).
"""

from rljob.weights.apply import named_tensors
from rljob.weights.codec import EncodedDelta
from rljob.weights.publisher import PublishResult, WeightPublisher
from rljob.weights.reader import SyncResult, WeightLayoutError, WeightReader
from rljob.weights.store import (
    ChecksumMismatchError,
    CorruptChunkError,
    MissingChunkError,
    NoWeightsPublishedError,
    VersionConflictError,
    VersionUnavailableError,
    WeightStoreError,
)

__all__ = [
    "ChecksumMismatchError",
    "CorruptChunkError",
    "EncodedDelta",
    "MissingChunkError",
    "NoWeightsPublishedError",
    "PublishResult",
    "SyncResult",
    "VersionConflictError",
    "VersionUnavailableError",
    "WeightLayoutError",
    "WeightPublisher",
    "WeightReader",
    "WeightStoreError",
    "named_tensors",
]
