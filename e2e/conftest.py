"""The `cluster` fixture: one real control plane (e2e/cluster) for the whole test session."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

from localcluster import LocalCluster, build_binaries


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    for tool in ("go", "openssl"):
        if shutil.which(tool) is None:
            pytest.fail(f"e2e tests need `{tool}` on PATH to build and start the control plane")
    bin_dir = build_binaries()
    started = time.monotonic()
    local = LocalCluster(bin_dir)
    try:
        local.start()
    except Exception:
        local.stop()
        raise
    local.start_seconds = time.monotonic() - started  # type: ignore[attr-defined]
    yield local
    local.stop()
