"""Rank 0's part of a training run: every piece of Redis work, in one object.

Questions, prompts out (up to `maxPolicyLag` steps ahead), groups in (with dynamic sampling's
refills), weights published, evaluations through the rollout workers, metrics written. The other
ranks only train; `loop._train` strings the two together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis

from rljob.config import RLJob
from rljob.keys import JobKeys
from rljob.protocol import PromptRequest, TrainerMetrics, TrajectoryGroup
from rljob.queue import trainer_end
from rljob.queue.trainer_end import TrajectoryCollector, clear_earlier_runs
from rljob.trainer.batch import informative_groups
from rljob.trainer.grpo import GRPOTrainer, StepStats
from rljob.trainer.metrics import MetricsWriter, eval_summary, rollout_metrics
from rljob.trainer.prompts import eval_requests, load_questions, refill_requests, step_requests
from rljob.weights import WeightPublisher

log = logging.getLogger(__name__)

EVAL_TIMEOUT_S = 3600.0  # an evaluation round not answered by then is skipped


@dataclass
class StepBatch:
    """What rank 0 gathered for one step: the groups, their stream entries, and how they were got."""

    groups: list[TrajectoryGroup]
    entry_ids: list[str]
    request_ids: list[str]
    informative: int
    refill_rounds: int
    started: float
    wait_seconds: float
    rollout: dict[str, float]


class Coordinator:
    """Rank 0's Redis work for one gang process: built at the start of a run (which publishes the
    first version and, on a fresh job, evaluates the starting point)."""

    def __init__(
        self,
        job: RLJob,
        trainer: GRPOTrainer,
        *,
        client: redis.Redis,
        writer: MetricsWriter,
        metrics: TrainerMetrics,
        start_step: int,
        resumed: bool,
        progress: bool = False,
    ) -> None:
        spec = job.spec
        self.job, self.trainer, self.client, self.writer, self.metrics = job, trainer, client, writer, metrics
        self.keys = JobKeys(job.metadata.namespace, job.metadata.name)
        self.questions, scored = load_questions(job)
        self.eval_questions = scored[: spec.eval.questions]
        if resumed:  # the group counts go on from where the run left them
            earlier = TrainerMetrics.from_redis(client.hgetall(self.keys.metrics) or {})
            metrics.groups_generated_total = earlier.groups_generated_total
            metrics.groups_dropped_total = earlier.groups_dropped_total
        self.publisher = WeightPublisher.from_spec(client, self.keys, spec.weight_sync)
        published = self.publisher.publish(trainer.model)  # version 0 (full) on a fresh job
        self.version = published.version
        self.run_tag = str(self.version)  # keeps request ids unique across restarts
        metrics.policy_version, metrics.weight_bytes, metrics.step = self.version, published.bytes, start_step
        writer.write(metrics, log=False)
        self.collector = TrajectoryCollector(client, self.keys)
        clear_earlier_runs(client, self.keys)  # before this run enqueues anything
        self.enqueued_through = start_step - 1
        self.dropped_stale_total = 0
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=spec.grpo.total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True
            )
        if not resumed and spec.eval.interval and self.eval_questions:
            # The starting point (after any warm-up), so every run reports before and after.
            before = self.evaluate(0)
            if before is not None:
                writer.write_eval("eval_before", before)
                writer.write(metrics, log=False)

    def gather(self, step: int) -> StepBatch:
        """Enqueue up to `maxPolicyLag` steps ahead, then wait for this step's groups, asking for
        refills while too few groups carry signal (dynamic sampling)."""
        grpo, lag, version = self.job.spec.grpo, self.job.spec.grpo.max_policy_lag, self.version
        started = time.perf_counter()
        while self.enqueued_through < min(step + lag, grpo.total_steps - 1):
            k = self.enqueued_through + 1
            self._ask(step_requests(k, self.questions, self.job, max(0, version + (k - step) - lag), self.run_tag))
            self.enqueued_through = k
        wanted = [r.request_id for r in step_requests(step, self.questions, self.job, 0, self.run_tag)]
        groups, entry_ids = self._collect(step, wanted)
        informative, rounds = informative_groups(groups, version, lag), 0
        while grpo.dynamic_sampling and informative < grpo.questions_per_step and rounds < grpo.max_refill_rounds:
            more = grpo.questions_per_step - informative
            reqs = refill_requests(step, rounds, more, self.questions, self.job, version, self.run_tag)
            self._ask(reqs)
            extra, extra_ids = self._collect(step, [r.request_id for r in reqs])
            groups, entry_ids = groups + extra, entry_ids + extra_ids
            wanted += [r.request_id for r in reqs]
            informative, rounds = informative_groups(groups, version, lag), rounds + 1
        self.metrics.groups_generated_total += len(groups)
        self.metrics.groups_dropped_total += len(groups) - informative
        return StepBatch(
            groups=groups,
            entry_ids=entry_ids,
            request_ids=wanted,
            informative=informative,
            refill_rounds=rounds,
            started=started,
            wait_seconds=time.perf_counter() - started,
            rollout=rollout_metrics(groups),
        )

    def finish(self, step: int, batch: StepBatch, stats: StepStats) -> None:
        """After every rank trained `step`: publish, acknowledge its groups, evaluate when due, record."""
        spec = self.job.spec
        published = self.publisher.publish(self.trainer.model)
        self.version = published.version
        self.collector.ack(batch.entry_ids, done=batch.request_ids)
        self.dropped_stale_total += stats.dropped_stale
        _update(
            self.metrics,
            {
                **batch.rollout,
                "state": "running",
                "step": step + 1,
                "policy_version": self.version,
                "step_seconds": time.perf_counter() - batch.started,
                "wait_seconds": batch.wait_seconds,
                "train_seconds": stats.train_seconds,
                "dropped_stale": stats.dropped_stale,
                "weight_bytes": published.bytes,
                "updated_at": time.time(),
            },
        )
        extra: dict[str, Any] = {f"train_{k}": v for k, v in asdict(stats).items()}
        extra.update(
            weight_kind=published.kind,
            weight_changed=published.changed,
            dropped_stale_total=self.dropped_stale_total,
            groups_generated=len(batch.groups),
            groups_informative=batch.informative,
            refill_rounds=batch.refill_rounds,
            informative_group_rate=batch.informative / max(len(batch.groups), 1),
            learning_rate=self.trainer.learning_rate,
        )
        last = step + 1 == spec.grpo.total_steps
        if spec.eval.interval and self.eval_questions and ((step + 1) % spec.eval.interval == 0 or last):
            eval_started = time.perf_counter()
            result = self.evaluate(step + 1)
            extra["eval_seconds"] = time.perf_counter() - eval_started
            if result is not None:
                self.writer.write_eval(f"eval_step{step + 1}", result)  # per question: EM at equal wall time
                if last:
                    self.writer.write_eval("eval_after", result)
        self.writer.write(self.metrics, extra)
        _show(self.bar, self.metrics)

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """Greedy answers to held-out questions from the rollout workers at the just-published version."""
        try:
            groups = trainer_end.eval_round(
                self.client,
                self.keys,
                eval_requests(step, self.eval_questions, self.version),
                timeout_s=EVAL_TIMEOUT_S,
                on_wait=self.publisher.answer_rebase,
            )
        except TimeoutError as exc:
            log.warning("eval at step %d skipped: %s", step, exc)
            return None
        result = eval_summary(groups)
        _update(self.metrics, {"eval_step": step, "eval_exact_match": result["exact_match"], "eval_f1": result["f1"]})
        return {**result, "step": step, "policy_version": self.version}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _ask(self, requests: Sequence[PromptRequest]) -> None:
        self.collector.expect(requests)
        trainer_end.enqueue_prompts(self.client, self.keys.prompts, requests)

    def _collect(self, step: int, request_ids: list[str]) -> tuple[list[TrajectoryGroup], list[str]]:
        # While waiting, answer a reader's rebase request: the next publish waits on these very rollouts.
        return self.collector.collect(step, request_ids, on_wait=self.publisher.answer_rebase)


def _update(metrics: TrainerMetrics, values: dict[str, Any]) -> None:
    """In place: `run_trainer` records the final state on this very object."""
    for name, value in values.items():
        setattr(metrics, name, value)


def _show(bar: Any, m: TrainerMetrics) -> None:
    fields = {
        "reward": f"{m.mean_reward:.3f}",
        "em": f"{m.exact_match:.3f}",
        "step_s": f"{m.step_seconds:.1f}",
        "wait_s": f"{m.wait_seconds:.1f}",
        "bytes": m.weight_bytes,
        "v": m.policy_version,
    }
    if m.eval_exact_match is not None:
        fields["eval_em"] = f"{m.eval_exact_match:.3f}"
    if bar is not None:
        bar.set_postfix(fields, refresh=False)
        bar.update(1)
    else:
        log.info("step %d/%d %s", m.step, m.total_steps, " ".join(f"{k}={v}" for k, v in fields.items()))
