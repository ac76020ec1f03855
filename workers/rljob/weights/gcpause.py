"""Keep Python's cyclic garbage collector out of a latency-critical section.

Publishing or applying a version allocates a few thousand small objects (the manifest's entries),
which can trigger a full collection, longer than a whole delta, in the middle of a sync. The pause
is deferred, not removed: the collector runs again between versions, where nobody waits on it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the block (reference counting still frees memory); nests safely."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
