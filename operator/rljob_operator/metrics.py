"""Prometheus metrics of the operator, served on /metrics (port from settings)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

API_CALLS = Counter("rljob_operator_api_calls_total", "Kubernetes API requests made", ["verb"])
RECONCILES = Counter("rljob_operator_reconciles_total", "Reconcile passes", ["kind"])
RECONCILE_ERRORS = Counter("rljob_operator_reconcile_errors_total", "Reconcile passes that raised (kopf retries them)")
LAST_SUCCESS = Gauge(
    "rljob_operator_last_successful_reconcile_timestamp_seconds", "Unix time the last pass without an error ended"
)
RECONCILE_SECONDS = Histogram("rljob_operator_reconcile_seconds", "Duration of one reconcile pass")
GANG_RESTARTS = Counter("rljob_operator_gang_restarts_total", "Trainer gang restarts after failures")
JOB_STEP = Gauge("rljob_job_step", "Optimiser steps finished", ["namespace", "name"])
JOB_REWARD = Gauge("rljob_job_mean_reward", "Mean reward of the last step", ["namespace", "name"])
ROLLOUT_DESIRED = Gauge("rljob_job_rollout_replicas_desired", "Rollout workers wanted", ["namespace", "name"])
