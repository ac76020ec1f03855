"""Operator settings from the environment, in one place (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str  # where the operator runs (NetworkPolicy lets its pods reach each job's Redis)
    keda_namespace: str
    timer_interval: float  # status, failure detection and autoscaling cadence
    restart_backoff_seconds: float  # first gang-restart delay, doubled per restart, capped
    restart_backoff_max_seconds: float
    redis_timeout_seconds: float
    metrics_port: int
    # How often the timer checks that children it does not read every pass (ConfigMap, Services,
    # NetworkPolicy, Secret, KEDA objects) still exist, and re-applies them if one was deleted.
    child_check_seconds: float = 60.0
    # Benchmark baseline only: re-apply every child on every timer pass, like a naive operator.
    always_full: bool = False

    @classmethod
    def from_env(cls) -> OperatorSettings:
        return cls(
            namespace=os.environ.get("RLJOB_OPERATOR_NAMESPACE", "rljob-system"),
            keda_namespace=os.environ.get("RLJOB_KEDA_NAMESPACE", "keda"),
            timer_interval=_float("RLJOB_TIMER_INTERVAL", 10.0),
            restart_backoff_seconds=_float("RLJOB_RESTART_BACKOFF_SECONDS", 10.0),
            restart_backoff_max_seconds=_float("RLJOB_RESTART_BACKOFF_MAX_SECONDS", 300.0),
            redis_timeout_seconds=_float("RLJOB_REDIS_TIMEOUT_SECONDS", 1.0),
            metrics_port=int(os.environ.get("RLJOB_METRICS_PORT", "8080")),
            child_check_seconds=_float("RLJOB_CHILD_CHECK_SECONDS", 60.0),
            always_full=os.environ.get("RLJOB_ALWAYS_FULL", "") == "1",
        )

    def restart_backoff(self, restarts: int) -> float:
        """Delay before the gang is recreated after its `restarts`-th failure."""
        if restarts <= 0:
            return 0.0
        return min(self.restart_backoff_seconds * 2 ** (restarts - 1), self.restart_backoff_max_seconds)
