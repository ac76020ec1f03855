"""Open a data file as text whether it is plain or gzip-compressed (the bundled sample is `.jsonl.gz`)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: str | Path) -> IO[str]:
    """A UTF-8 text stream over `path`, decompressing on the fly when it is gzip: told by content,
    not by name, so a `.jsonl` that holds gzip bytes reads as well as a `.jsonl.gz`."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == GZIP_MAGIC
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")
