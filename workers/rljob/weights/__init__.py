"""Weight store: trainer publishes bf16 versions (full or delta) to Redis, rollout workers sync.

See `publisher` (trainer side), `reader` (rollout side), `changes` (finding what changed),
`encoding` (pure delta codecs, built on `intcodes` for positions and `bitfields` for packing),
`checksum`, `apply` (in-place writes), `store` (Redis layout), `manifest` (what a version is).
"""

from rljob.weights.apply import apply_delta, named_tensors
from rljob.weights.encoding import EncodedDelta, apply_delta_bits, decode_delta, encode_delta
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
    "apply_delta",
    "apply_delta_bits",
    "decode_delta",
    "encode_delta",
    "named_tensors",
]
