"""The operator's Redis read (metrics hash + prompt backlog) against a real password-protected
redis-server, and the degraded condition when Redis cannot be reached."""

from __future__ import annotations

import logging
import time

import pytest

from rljob.config import RLJob
from rljob.embedded_redis import EmbeddedRedis
from rljob.keys import ROLLOUT_GROUP, JobKeys
from rljob.ports import free_port
from rljob.protocol import TrainerMetrics
from rljob_operator.api import RLJobStatus
from rljob_operator.decide import Observed, TrainerDecision
from rljob_operator.reconcile import Reconciler
from rljob_operator.settings import OperatorSettings
from rljob_operator.status import compute_status

PASSWORD = "pw-never-logged-0123456789"
SETTINGS = OperatorSettings("rljob-system", "keda", 1.0, 1.0, 10.0, redis_timeout_seconds=0.5, metrics_port=0)


def job_for(url: str) -> RLJob:
    spec = {"weightSync": {"redis": {"externalUrl": url, "passwordSecret": "ext"}}}
    return RLJob.model_validate({"metadata": {"name": "j", "namespace": "ns"}, "spec": spec})


def reconciler(job: RLJob) -> Reconciler:
    # No API server here: the password the reconciler would read from the Secret is pre-seeded.
    r = Reconciler(kube=None, settings=SETTINGS, post_event=lambda *a: None, log=logging.getLogger("t"))  # type: ignore[arg-type]
    r.memory(job.metadata.namespace, job.metadata.name).password = PASSWORD
    return r


@pytest.mark.integration
def test_metrics_and_backlog_from_real_redis(tmp_path) -> None:
    with EmbeddedRedis(tmp_path / "r", password=PASSWORD) as server:
        import redis

        client = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
        keys = JobKeys("ns", "j")
        client.hset(
            keys.metrics,
            mapping=TrainerMetrics(
                step=7, policy_version=7, mean_reward=0.5, eval_exact_match=0.25, weight_bytes=99
            ).to_redis(),
        )
        for i in range(5):
            client.xadd(keys.prompts, {"data": str(i)})
        client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
        job = job_for(f"redis://127.0.0.1:{server.port}/0")
        metrics, backlog, error = reconciler(job)._read_redis(job)
        assert error is None and backlog == 5
        assert metrics is not None and metrics.step == 7
        st = compute_status(
            job, 1, RLJobStatus(), Observed(external_redis=True), TrainerDecision("apply"), 1, metrics, error, 0.0
        )
        assert (st.step, st.policy_version, st.mean_reward, st.eval_exact_match, st.weight_bytes_last_step) == (
            7,
            7,
            0.5,
            0.25,
            99,
        )
        client.close()


@pytest.mark.integration
def test_unreachable_or_wrong_password_degrades_without_leaking(tmp_path) -> None:
    job = job_for(f"redis://127.0.0.1:{free_port()}/0")
    metrics, backlog, error = reconciler(job)._read_redis(job)
    assert metrics is None and backlog is None and error and "ConnectionError" in error
    with EmbeddedRedis(tmp_path / "r", password="another-password") as server:
        job = job_for(f"redis://127.0.0.1:{server.port}/0")
        metrics, _, error = reconciler(job)._read_redis(job)
        assert metrics is None and error and PASSWORD not in error


@pytest.mark.integration
def test_a_blip_backs_off_but_the_final_metrics_are_read_anyway(tmp_path) -> None:
    # Redis down for one read: the next reads wait out a backoff (2 s, doubling to 30 s while the
    # failures go on: a new job's Redis is not up at its first reads), except the read of the pass
    # that records the job as finished (found by e2e/test_real_workers: Succeeded at step 2 of 5).
    with EmbeddedRedis(tmp_path / "r", password=PASSWORD) as server:
        job = job_for(f"redis://127.0.0.1:{server.port}/0")
        r = reconciler(job)
        server.kill()
        assert r._read_redis(job)[2] is not None
        assert 0 < r.memory("ns", "j").redis_retry_at - time.time() <= 2.0
        r.memory("ns", "j").password = PASSWORD  # the reconciler reads the Secret again after a failure
        server.restart()
        import redis

        client = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
        client.hset(JobKeys("ns", "j").metrics, mapping=TrainerMetrics(step=5, state="succeeded").to_redis())
        assert r._read_redis(job)[0] is None  # still backing off
        metrics, _, error = r._read_redis(job, retry_now=True)
        assert error is None and metrics is not None and metrics.step == 5
        client.close()
