"""The trainer gang's main loop: Redis in, GRPO steps, weights and metrics out.

Rank 0 does all Redis work (enqueue prompts, collect trajectory groups, publish weights, write
metrics, evaluate, checkpoint) and hands each step's groups to the other ranks; every rank trains
on its shard. Versions: the publisher continues the sequence Redis holds, so after a restart the
first publish (of the checkpointed weights) is simply the next version.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rljob import evaluate
from rljob.config import RLJob
from rljob.keys import JobKeys
from rljob.protocol import EVAL_ID_PREFIX, PromptRequest, TrainerMetrics
from rljob.trainer.batch import informative_groups
from rljob.trainer.checkpoint import (
    REFERENCE_FILE,
    CheckpointRef,
    latest_checkpoint,
    load_checkpoint,
    load_reference,
    read_ref,
    remove_reference,
    restore_rng,
    save_checkpoint,
    save_reference,
    sees,
)
from rljob.trainer.distributed import (
    Gang,
    all_ranks,
    broadcast_object,
    broadcast_parameters,
    broadcast_state,
    close_gang,
    control_barrier,
    init_gang,
)
from rljob.trainer.grpo import GRPOTrainer, frozen_copy
from rljob.trainer.metrics import MetricsWriter, per_question_scores, rollout_metrics

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def epoch_order(epoch: int, total: int, seed: int) -> tuple[int, ...]:
    """Epoch `epoch`'s shuffle of the `total` training questions.

    Cached: shuffling costs O(total) (~90k HotpotQA questions), and every step reads a slice of
    the same one or two epochs, twice; a few entries cover a step straddling epochs plus look-ahead.
    """
    order = list(range(total))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def question_slots(first: int, count: int, total: int, seed: int) -> list[int]:
    """Questions at positions first..first+count-1 of the endless sequence of per-epoch shuffles."""
    out = []
    for slot in range(first, first + count):
        epoch, pos = divmod(slot, total)
        out.append(epoch_order(epoch, total, seed)[pos])
    return out


def question_indices(step: int, per_step: int, total: int, seed: int) -> list[int]:
    """Which training questions step `step` uses: consecutive slices of a per-epoch shuffle.

    A pure function of the step, so a resumed run asks exactly what an uninterrupted one would;
    O(per_step) once the epoch's order is cached.
    """
    return question_slots(step * per_step, per_step, total, seed)


REFILL_SEED = 500_009  # refill prompts come from their own shuffle, not the next steps' questions


def refill_requests(
    step: int, round_: int, count: int, questions: Sequence[Any], job: RLJob, min_policy_version: int, run_tag: str
) -> list[PromptRequest]:
    """Extra prompts for step `step` (dynamic sampling), round `round_`: at most questionsPerStep."""
    grpo = job.spec.grpo
    first = (step * max(grpo.max_refill_rounds, 1) + round_) * grpo.questions_per_step
    idx = question_slots(first, min(count, grpo.questions_per_step), len(questions), job.spec.data.seed + REFILL_SEED)
    return [
        _training_prompt(
            f"s{step}-x{round_}-q{slot}-r{run_tag}-{questions[i].id}", step, questions[i], job, min_policy_version
        )
        for slot, i in enumerate(idx)
    ]


def _training_prompt(request_id: str, step: int, question: Any, job: RLJob, min_policy_version: int) -> PromptRequest:
    return PromptRequest(
        request_id=request_id,
        step=step,
        question_id=question.id,
        question=question.question,
        answers=list(question.answers),
        group_size=job.spec.grpo.group_size,
        min_policy_version=min_policy_version,
    )


def step_requests(
    step: int, questions: Sequence[Any], job: RLJob, min_policy_version: int, run_tag: str = ""
) -> list[PromptRequest]:
    """Step `step`'s prompts. `run_tag` (the first version this gang process published) keeps ids
    unique across restarts: rollout workers answer a request id only once, so a restarted trainer
    that re-asks for a step must use new ids."""
    grpo = job.spec.grpo
    idx = question_indices(step, grpo.questions_per_step, len(questions), job.spec.data.seed)
    return [
        _training_prompt(f"s{step}-q{slot}-r{run_tag}-{questions[i].id}", step, questions[i], job, min_policy_version)
        for slot, i in enumerate(idx)
    ]


def eval_requests(step: int, questions: Sequence[Any], version: int) -> list[PromptRequest]:
    """Greedy requests scoring the weights of `step` (policy `version`), with ids no other step shares."""
    return evaluate.eval_requests(
        questions, f"{EVAL_ID_PREFIX}s{step}-v{version}", step=step, min_policy_version=version
    )


def load_questions(job: RLJob) -> tuple[list[Any], list[Any]]:
    """(RL prompt pool, the questions evaluations score): the warm-up's pool and the validation slice
    are out of the RL pool, and so is any training question the evaluation set also holds. Evaluations
    score the evaluation set, or the validation slice under `eval.split: validation`."""
    from rljob.data import load_questions_for_spec
    from rljob.data.pools import job_pools

    train, evaluation = load_questions_for_spec(job.spec.data)
    pools = job_pools(job.spec, [q.id for q in train], [q.id for q in evaluation])
    rl = [train[i] for i in pools.rl]
    sizes = pools.sizes()
    if job.spec.grpo.answerable_only:
        rl = answerable_questions(job, rl, train, evaluation)
        sizes["rl_answerable"] = len(rl)
        if not rl:
            raise ValueError(
                "grpo.answerableOnly: no RL question's answer appears in its retrieved passages; raise agent.topK "
                "or agent.passageMaxWords, or turn answerableOnly off"
            )
    scored = [train[i] for i in pools.validation] if job.spec.eval.split == "validation" else evaluation
    log.info(
        "question pools: %s of %d training questions; %d evaluation questions; evaluations score the %s",
        sizes,
        len(train),
        len(evaluation),
        job.spec.eval.split,
    )
    return rl, scored


def answerable_questions(job: RLJob, questions: Sequence[Any], train: Sequence[Any], evaluation: Sequence[Any]) -> list:
    """The questions whose gold answer is in what the job's retriever returns for the question itself
    (about a second for 2,000 questions on CPU)."""
    from rljob.retrieval.retriever import retriever_for
    from rljob.warmup.demonstrations import answer_found

    agent = job.spec.agent
    hits = retriever_for(job.spec.data, train, evaluation).search_batch([q.question for q in questions], agent.top_k)
    return [
        q
        for q, passages in zip(questions, hits, strict=True)
        if any(answer_found(a, passages, agent.passage_max_words) for a in q.answers)
    ]


def load_policy_model(job: RLJob) -> torch.nn.Module:
    from rljob.trainer.model import load_policy

    return load_policy(job.spec.model)


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run_trainer(
    job: RLJob,
    redis_url: str,
    checkpoint_dir: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    results_dir: str | None = None,
    progress: bool = True,
    collect_timeout_s: float | None = None,
    eval_timeout_s: float = 3600.0,
) -> None:
    """Train `job` to `grpo.totalSteps`, resuming from the newest checkpoint in `checkpoint_dir`."""
    device = _device()
    gang = init_gang(device, rank=rank, world_size=world_size)
    client = writer = None
    metrics = TrainerMetrics(total_steps=job.spec.grpo.total_steps)
    try:
        if gang.is_main:
            from rljob.redis_client import connect

            client = connect(redis_url)
            writer = MetricsWriter(client, JobKeys(job.metadata.namespace, job.metadata.name), results_dir)
        _train(job, gang, device, client, writer, metrics, checkpoint_dir, progress, collect_timeout_s, eval_timeout_s)
        if writer is not None:
            writer.finish(metrics, succeeded=True)
    except BaseException as exc:
        if writer is not None:
            try:
                writer.finish(metrics, succeeded=False, message=f"{type(exc).__name__}: {exc}")
            except Exception:  # Redis itself may be what failed
                log.exception("could not record the failure in Redis")
        raise
    finally:
        close_gang(gang)
        if client is not None:
            client.close()


def _train(
    job: RLJob,
    gang: Gang,
    device: torch.device,
    client: Any,
    writer: MetricsWriter | None,
    metrics: TrainerMetrics,
    checkpoint_dir: str,
    progress: bool,
    collect_timeout_s: float | None,
    eval_timeout_s: float,
) -> None:
    spec = job.spec
    grpo = spec.grpo
    keys = JobKeys(job.metadata.namespace, job.metadata.name)
    torch.manual_seed(grpo.seed)
    random.seed(grpo.seed)

    trainer, resumed = prepare_trainer(job, gang, device, writer, checkpoint_dir, progress)
    start_step = resumed.step if resumed is not None else 0

    questions = eval_questions = None
    run_tag = ""
    publisher = collector = None
    version = 0
    if gang.is_main:
        from rljob.queue.trainer_end import TrajectoryCollector, clear_earlier_runs
        from rljob.weights import WeightPublisher

        questions, eval_all = load_questions(job)
        eval_questions = eval_all[: spec.eval.questions]
        if resumed is not None:  # the group counts go on from where the run left them
            earlier = TrainerMetrics.from_redis(client.hgetall(keys.metrics) or {})
            metrics.groups_generated_total = earlier.groups_generated_total
            metrics.groups_dropped_total = earlier.groups_dropped_total
        publisher = WeightPublisher.from_spec(client, keys, spec.weight_sync)
        published = publisher.publish(trainer.model)  # version 0 (full) on a fresh job
        version = published.version
        run_tag = str(version)
        metrics.policy_version, metrics.weight_bytes, metrics.step = version, published.bytes, start_step
        writer.write(metrics, log=False)
        collector = TrajectoryCollector(client, keys, consumer=f"trainer-{gang.rank}")
        clear_earlier_runs(client, keys)  # before this run enqueues anything
        if resumed is None and spec.eval.interval and eval_questions:
            # The starting point (after any warm-up), so every run reports before and after.
            before = _evaluate(client, keys, eval_questions, 0, version, metrics, eval_timeout_s, publisher)
            if before is not None:
                writer.write_eval("eval_before", before)
                writer.write(metrics, log=False)
    version = broadcast_object(gang, version)

    lag = grpo.max_policy_lag
    dropped_total = 0
    informative = rounds = 0
    enqueued_through = start_step - 1
    bar = _progress_bar(progress and gang.is_main, grpo.total_steps, start_step)
    for step in range(start_step, grpo.total_steps):
        step_started = time.perf_counter()
        groups = entry_ids = None
        roll: dict[str, float] = {}
        if gang.is_main:
            from rljob.queue.trainer_end import enqueue_prompts

            # Prompts for up to `lag` future steps are already out while this one trains.
            while enqueued_through < min(step + lag, grpo.total_steps - 1):
                k = enqueued_through + 1
                reqs = step_requests(k, questions, job, max(0, version + (k - step) - lag), run_tag)
                collector.expect(reqs)
                enqueue_prompts(client, keys.prompts, reqs)
                enqueued_through = k
            wanted = [r.request_id for r in step_requests(step, questions, job, 0, run_tag)]
            groups, entry_ids = collector.collect(
                step, wanted, timeout_s=collect_timeout_s, on_wait=lambda *_: answer_rebase(publisher)
            )
            informative, rounds = informative_groups(groups, version, lag), 0
            while grpo.dynamic_sampling and informative < grpo.questions_per_step and rounds < grpo.max_refill_rounds:
                reqs = refill_requests(
                    step, rounds, grpo.questions_per_step - informative, questions, job, version, run_tag
                )
                collector.expect(reqs)
                enqueue_prompts(client, keys.prompts, reqs)
                more, more_ids = collector.collect(
                    step,
                    [r.request_id for r in reqs],
                    timeout_s=collect_timeout_s,
                    on_wait=lambda *_: answer_rebase(publisher),
                )
                groups, entry_ids = groups + more, entry_ids + more_ids
                wanted += [r.request_id for r in reqs]
                informative, rounds = informative_groups(groups, version, lag), rounds + 1
            metrics.groups_generated_total += len(groups)
            metrics.groups_dropped_total += len(groups) - informative
            roll = rollout_metrics(groups)
        wait_seconds = time.perf_counter() - step_started
        groups = broadcast_object(gang, groups)

        stats = trainer.train_step(groups, version)

        if gang.is_main:
            published = publisher.publish(trainer.model)
            version = published.version
            collector.ack(entry_ids, done=wanted)
            step_seconds = time.perf_counter() - step_started
            _update(
                metrics,
                {
                    **roll,
                    "state": "running",
                    "step": step + 1,
                    "policy_version": version,
                    "step_seconds": step_seconds,
                    "wait_seconds": wait_seconds,
                    "train_seconds": stats.train_seconds,
                    "dropped_stale": stats.dropped_stale,
                    "weight_bytes": published.bytes,
                    "updated_at": time.time(),
                },
            )
            dropped_total += stats.dropped_stale
            extra = {f"train_{k}": v for k, v in stats.as_dict().items()}
            extra.update(
                weight_kind=published.kind,
                weight_changed=published.changed,
                dropped_stale_total=dropped_total,
                groups_generated=len(groups),
                groups_informative=informative,
                refill_rounds=rounds,
                informative_group_rate=informative / max(len(groups), 1),
                learning_rate=trainer.learning_rate,
            )
            last = step + 1 == grpo.total_steps
            if spec.eval.interval and eval_questions and ((step + 1) % spec.eval.interval == 0 or last):
                eval_started = time.perf_counter()
                result = _evaluate(client, keys, eval_questions, step + 1, version, metrics, eval_timeout_s, publisher)
                extra["eval_seconds"] = time.perf_counter() - eval_started
                if result is not None:
                    writer.write_eval(f"eval_step{step + 1}", result)  # per question: EM at equal wall time
                    if last:
                        writer.write_eval("eval_after", result)
            writer.write(metrics, extra)
            _show(bar, metrics)
        version = broadcast_object(gang, version)

        if ((step + 1) % grpo.checkpoint_interval == 0 or step + 1 == grpo.total_steps) and gang.is_main:
            save_checkpoint(checkpoint_dir, step=step + 1, policy_version=version, trainer_state=trainer.state_dict())
    if bar is not None:
        bar.close()


def prepare_trainer(
    job: RLJob, gang: Gang, device: torch.device, writer: MetricsWriter | None, checkpoint_dir: str, progress: bool
) -> tuple[GRPOTrainer, CheckpointRef | None]:
    """The trainer this gang process starts from, and the checkpoint it resumed (None on a fresh job).

    Resuming restores the policy, optimiser, RNG states and the KL reference, so a restart changes
    nothing the run optimises against; a fresh job starts from the base model, warmed up if asked.
    """
    from rljob.precision import compute_dtype
    from rljob.trainer.model import pad_token_id_of

    spec = job.spec
    model = load_policy_model(job)
    ref = frozen_copy(model) if spec.grpo.kl_coef > 0 else None
    # Behaviour log-probs are of softmax(logits / T) (rljob.engines.base): score with the same T.
    dtype = compute_dtype(spec.model.dtype, device)
    log.info("trainer computes in %s (spec.model.dtype %s), master weights fp32", dtype, spec.model.dtype)
    trainer = GRPOTrainer(
        model,
        ref,
        spec.grpo,
        device,
        pad_token_id=pad_token_id_of(model),
        gang=gang,
        temperature=spec.agent.temperature,
        compute_dtype=dtype,
    )
    control_barrier(gang)  # a slow load (a download, a cold disk) must not run into the collective timeout
    broadcast_parameters(gang, trainer.model)  # after the move to the device: nccl broadcasts CUDA tensors

    resumed = resume(gang, trainer, checkpoint_dir)
    if resumed is not None:
        _restore_reference(job, gang, trainer, checkpoint_dir)
        log.info("resumed from %s at step %d", resumed.name, resumed.step)
        return trainer, resumed
    if gang.is_main:
        remove_reference(checkpoint_dir)  # an earlier run's, which this one must never resume against
    if spec.warmup.enabled:
        warm_up(job, gang, trainer, device, writer, progress)
        if gang.is_main and trainer.ref_model is not None:
            # Before the first checkpoint, so every checkpoint of this run has its reference on disk.
            save_reference(checkpoint_dir, trainer.ref_model.state_dict())
    return trainer, None


def resume(gang: Gang, trainer: GRPOTrainer, checkpoint_dir: str) -> CheckpointRef | None:
    """Load the newest checkpoint into `trainer` on every rank; None when there is none.

    Rank 0 picks it and sends only its name. Every rank that sees it (the trainers share the
    checkpoint volume) reads it itself; if any cannot, rank 0 sends the tensors one by one.
    Nothing is pickled whole, and the loaded state is dropped once applied: a pickled broadcast
    held about four copies of it on each rank (an OOM kill for a 3B model with Adam moments).
    """
    ref = None
    if gang.is_main:
        path = latest_checkpoint(checkpoint_dir)
        ref = read_ref(path) if path is not None else None
    ref = broadcast_object(gang, ref)
    if ref is None:
        return None
    path, mapped = Path(checkpoint_dir) / ref.name, trainer.device.type != "cpu"
    if all_ranks(gang, sees(checkpoint_dir, ref)):
        _apply(trainer, _read_state(path, mapped))
    else:
        log.warning("not every rank sees %s in %s: rank 0 sends it", ref.name, checkpoint_dir)
        _apply(trainer, broadcast_state(gang, _read_state(path, mapped) if gang.is_main else None))
    if mapped:
        own_cpu_tensors(trainer.optimizer)
    control_barrier(gang)  # ranks read at their own pace; the next main-group collective must not wait on it
    return ref


def _read_state(path: Path, mapped: bool) -> dict[str, Any]:
    """The trainer and RNG state at `path`, on the CPU; `mapped` for a trainer on another device.

    Mapped, the state is page cache that load_state_dict copies to the device, never process
    memory. A CPU trainer's optimiser adopts the loaded tensors as its own, so there a plain read
    costs no more and keeps no file mapped for the run.
    """
    ckpt = load_checkpoint(path, map_location="cpu", mmap=mapped)
    return {"trainer": ckpt.trainer, "rng": ckpt.rng}


def own_cpu_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Copy the optimiser state's CPU tensors (on a GPU trainer, AdamW's step counts).

    load_state_dict keeps them as loaded: mapped from the checkpoint, any one of them keeps the
    whole file mapped, and once retention deletes it, on disk, for the rest of the run.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                state[key] = value.clone()


def _apply(trainer: GRPOTrainer, state: dict[str, Any]) -> None:
    """Load `state` into the trainer and the RNGs; the caller keeps no reference to it."""
    trainer.load_state_dict(state.pop("trainer"))
    restore_rng(state.pop("rng"))


def _restore_reference(job: RLJob, gang: Gang, trainer: GRPOTrainer, checkpoint_dir: str) -> None:
    """Load the KL reference saved after the warm-up; without one it stays the base model, as it was."""
    if trainer.ref_model is None:
        return
    found = False
    if gang.is_main:
        state = load_reference(checkpoint_dir)
        if state is not None:
            trainer.ref_model.load_state_dict(state)
            found = True
        elif job.spec.warmup.enabled:
            log.warning(
                "no %s beside the checkpoints in %s: the KL reference is now the base model, not the "
                "warmed-up policy the run started with",
                REFERENCE_FILE,
                checkpoint_dir,
            )
    if broadcast_object(gang, found):
        broadcast_parameters(gang, trainer.ref_model)


def warm_up(
    job: RLJob, gang: Gang, trainer: GRPOTrainer, device: torch.device, writer: MetricsWriter | None, progress: bool
) -> None:
    """Supervised protocol warm-up on rank 0, before version 0 is published; a fresh job only.

    Every rank then receives rank 0's weights, and a KL reference becomes the warmed-up policy.
    The other ranks wait on the long-timeout control group: a warm-up outlasts the collective timeout.
    """
    done = None
    if gang.is_main:
        from rljob.warmup import warmup_for_job

        result = warmup_for_job(job, trainer.model, device, progress=progress, autocast_dtype=trainer.autocast_dtype)
        log.info(
            "warm-up: %d demonstrations, %d steps, loss %.3f -> %.3f in %.0fs",
            result.examples,
            result.steps,
            result.first_loss,
            result.last_loss,
            result.seconds,
        )
        if writer is not None:
            writer.write_eval("warmup", result.as_dict())
        done = result.steps
    broadcast_object(gang, done)
    broadcast_parameters(gang, trainer.model)
    if trainer.ref_model is not None:
        trainer.ref_model.load_state_dict(trainer.model.state_dict())


def _evaluate(
    client: Any,
    keys: JobKeys,
    questions: Sequence[Any],
    step: int,
    version: int,
    metrics: TrainerMetrics,
    timeout_s: float,
    publisher: Any = None,
) -> dict[str, Any] | None:
    """Greedy answers to held-out questions from the rollout workers at the just-published version."""
    from rljob.queue.trainer_end import eval_round

    try:
        groups = eval_round(
            client,
            keys,
            eval_requests(step, questions, version),
            timeout_s=timeout_s,
            on_wait=lambda: answer_rebase(publisher),
        )
    except TimeoutError as exc:
        log.warning("eval at step %d skipped: %s", step, exc)
        return None
    result = rollout_metrics(groups)
    _update(metrics, {"eval_step": step, "eval_exact_match": result["exact_match"], "eval_f1": result["f1"]})
    return {
        **result,
        "step": step,
        "policy_version": version,
        "questions": len(groups),
        "per_question": per_question_scores(groups),
    }


def answer_rebase(publisher: Any) -> None:
    """While the trainer waits on rollout workers: a reader that cannot apply what is stored (a
    chunk that stays corrupt, say) asks for a rebase and produces nothing until it can load the
    latest version, so the publisher re-exports it now (`WeightPublisher.answer_rebase`) rather
    than at the next publish, which would never come."""
    if publisher is not None:
        publisher.answer_rebase()


def _update(metrics: TrainerMetrics, values: dict[str, Any]) -> None:
    """In place: `run_trainer` records the final state on this very object."""
    for name, value in values.items():
        setattr(metrics, name, value)


def _progress_bar(enabled: bool, total: int, initial: int) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="grpo", unit="step", dynamic_ncols=True)


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


def default_checkpoint_dir(job: RLJob) -> str:
    return str(Path(os.environ.get("RLJOB_CHECKPOINT_DIR", "/checkpoints")) / job.metadata.name)
