"""Helpers shared by the benchmark scripts: progress lines, results folder, JSON last line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def progress(message: str) -> None:
    print(message, flush=True)


def finish(name: str, summary: dict, results: Path | None = None) -> None:
    """Write <results>/<name>.json (default docs/results) and print the summary as the last stdout line."""
    folder = RESULTS if results is None else Path(results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
