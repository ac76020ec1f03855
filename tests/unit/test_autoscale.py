"""Operator-native autoscaling: backlog -> replicas within bounds, scale-down cooldown."""

from __future__ import annotations

import pytest

from rljob.config import RolloutSpec
from rljob.queue.backlog import backlog_from_groups
from rljob_operator.autoscale import desired_replicas

SPEC = RolloutSpec(min_replicas=1, max_replicas=6, pending_per_replica=8, scale_down_cooldown_seconds=60)


@pytest.mark.parametrize(("backlog", "want"), [(0, 1), (8, 1), (9, 2), (40, 5), (1000, 6)])
def test_replicas_follow_backlog_within_bounds(backlog: int, want: int) -> None:
    assert desired_replicas(current=1, backlog=backlog, spec=SPEC, seconds_since_scale=None) == want


def test_scale_down_waits_for_cooldown_but_scale_up_does_not() -> None:
    assert desired_replicas(current=5, backlog=0, spec=SPEC, seconds_since_scale=10) == 5
    assert desired_replicas(current=5, backlog=0, spec=SPEC, seconds_since_scale=61) == 1
    assert desired_replicas(current=2, backlog=48, spec=SPEC, seconds_since_scale=1) == 6


def test_unknown_backlog_keeps_current_in_bounds() -> None:
    assert desired_replicas(current=3, backlog=None, spec=SPEC, seconds_since_scale=None) == 3
    assert desired_replicas(current=0, backlog=None, spec=SPEC, seconds_since_scale=None) == 1
    assert desired_replicas(current=9, backlog=None, spec=SPEC, seconds_since_scale=None) == 6


def test_backlog_is_lag_plus_pending_of_the_rollout_group() -> None:
    groups = [{"name": b"trainer", "lag": 100, "pending": 100}, {"name": b"rollout", "lag": 7, "pending": 3}]
    assert backlog_from_groups(groups, stream_length=50) == 10
    # No lag from Redis: acknowledged prompts are deleted, so the stream holds exactly the backlog.
    assert backlog_from_groups([{"name": "rollout", "lag": None, "pending": 2}], stream_length=5) == 5
    assert backlog_from_groups([], stream_length=4) == 4


def test_the_operator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, rljob_operator.reconcile, rljob_operator.handlers; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_rollout_replicas_follow_the_backlog_unless_forced_off_or_owned_by_keda() -> None:
    from rljob.config import RLJob
    from rljob_operator.autoscale import rollout_replicas

    job = RLJob.model_validate({"spec": {"rollout": {"minReplicas": 1, "maxReplicas": 5, "pendingPerReplica": 4}}})
    deployment = {"spec": {"replicas": 2}}
    assert rollout_replicas(job, deployment, 17, forced_off=False, seconds_since_scale=None) == (2, 5)
    assert rollout_replicas(job, deployment, 17, forced_off=True, seconds_since_scale=None) == (2, 0)
    assert rollout_replicas(job, None, None, forced_off=False, seconds_since_scale=None) == (1, 1)
    keda = RLJob.model_validate({"spec": {"rollout": {"minReplicas": 3, "autoscaler": "keda"}}})
    assert rollout_replicas(keda, deployment, 100, forced_off=False, seconds_since_scale=None) == (2, 3)
