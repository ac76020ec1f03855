"""The `cluster` fixture: one real control plane (e2e/cluster) for the whole test session, of
build.sh's default Kubernetes version; `previous_cluster` one of the previous minor."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

from localcluster import LocalCluster, build_binaries, supported_kube_versions


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@contextmanager
def running_cluster(kube_version: str | None = None) -> Iterator[LocalCluster]:
    """A control plane of build.sh's default Kubernetes version, or of `kube_version`."""
    for tool in ("go", "openssl"):
        if shutil.which(tool) is None:
            pytest.fail(f"e2e tests need `{tool}` on PATH to build and start the control plane")
    bin_dir = build_binaries(kube_version)
    started = time.monotonic()
    local = LocalCluster(bin_dir)
    try:
        local.start()
        local.start_seconds = time.monotonic() - started  # type: ignore[attr-defined]
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster() as local:
        yield local


@pytest.fixture(scope="module")
def previous_cluster() -> Iterator[LocalCluster]:
    """A control plane of the previous Kubernetes minor build.sh pins, for the modules that
    check what differs between versions (up only while such a module runs)."""
    with running_cluster(supported_kube_versions()[1]) as local:
        yield local
