"""kopf handlers: thin. Each reads which RLJob changed and calls the reconciler.

- create / update / resume: a full reconcile (apply every child).
- timer: status from children and Redis metrics, gang failures and restarts, autoscaling.
- delete: nothing to clean up by hand; owner references cascade. Only caches are dropped.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import kopf
import prometheus_client

from rljob.config import API_GROUP, API_VERSION, PLURAL
from rljob_operator.kube import Kube
from rljob_operator.reconcile import Reconciler
from rljob_operator.settings import OperatorSettings

SETTINGS = OperatorSettings.from_env()


def _post_event(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason, message=message)


@functools.cache
def reconciler() -> Reconciler:
    return Reconciler(Kube.from_environment(), SETTINGS, _post_event)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base live in our own annotations; status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    # kopf puts a finalizer on objects with timers (to stop them cleanly); name it after our API.
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    # RLJobs are found by discovery at start-up; no CRD watch, so no RBAC on CRDs (least privilege).
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # explicit events only, not every log line
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    prometheus_client.start_http_server(SETTINGS.metrics_port)  # serves rljob_operator.metrics
    reconciler()


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
def apply_children(namespace: str, name: str, **_: Any) -> None:
    reconciler().reconcile(namespace, name, full=True)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=SETTINGS.timer_interval, initial_delay=SETTINGS.timer_interval)
def observe(namespace: str, name: str, **_: Any) -> None:
    reconciler().reconcile(namespace, name, full=False)


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL, optional=True)
def forget(namespace: str, name: str, **_: Any) -> None:
    reconciler().forget(namespace, name)
