"""Helpers shared by the benchmark scripts: progress lines, results folder, JSON last line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def progress(message: str) -> None:
    print(message, flush=True)


def finish(name: str, summary: dict) -> None:
    """Write docs/results/<name>.json and print the summary as the last stdout line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
