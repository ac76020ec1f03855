"""Weight store: trainer publishes bf16 versions (full or delta) to Redis, rollout workers sync.

See `publisher` (trainer side), `reader` (rollout side), `changes` (finding what changed),
`codec` (the one delta coding), `checksum`, `apply` (in-place writes), `store` (Redis layout and
commit protocol), `manifest` (what a version is), `parallel` (the per-tensor thread pool).
"""

from rljob.weights.apply import named_tensors
from rljob.weights.publisher import WeightPublisher
from rljob.weights.reader import SyncResult, WeightReader
from rljob.weights.store import VersionConflictError, WeightStoreError

__all__ = [
    "SyncResult",
    "VersionConflictError",
    "WeightPublisher",
    "WeightReader",
    "WeightStoreError",
    "named_tensors",
]
