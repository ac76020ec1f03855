"""The error a malformed delta raises, shared by the modules that decode one."""

from __future__ import annotations


class DeltaFormatError(ValueError):
    """An encoded delta is malformed (truncated stream, unknown codec, wrong sizes)."""
