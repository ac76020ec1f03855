"""The trainer gang's main loop: Redis in, GRPO steps, weights and metrics out.

Rank 0 does all Redis work through its `Coordinator` (enqueue prompts, collect trajectory groups,
publish weights, write metrics, evaluate) and hands each step's groups to the other ranks; every
rank trains on its shard; rank 0 checkpoints. Versions: the publisher continues the sequence Redis
holds, so after a restart the first publish (of the checkpointed weights) is simply the next version.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
import torch

from rljob.config import RLJob
from rljob.keys import JobKeys
from rljob.protocol import TrainerMetrics
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
from rljob.trainer.metrics import MetricsWriter

log = logging.getLogger(__name__)


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
    results_dir: str | None = None,
    progress: bool = True,
) -> None:
    """Train `job` to `grpo.totalSteps`, resuming from the newest checkpoint in `checkpoint_dir`."""
    device = _device()
    gang = init_gang(device)
    client = writer = None
    metrics = TrainerMetrics(total_steps=job.spec.grpo.total_steps)
    finished = False
    try:
        if gang.is_main:
            from rljob.redis_client import connect

            client = connect(redis_url)
            writer = MetricsWriter(client, JobKeys(job.metadata.namespace, job.metadata.name), results_dir)
        _train(job, gang, device, client, writer, metrics, checkpoint_dir, progress)
        if writer is not None:
            writer.finish(metrics, succeeded=True)
        finished = True
    except BaseException as exc:
        if writer is not None:
            try:
                writer.finish(metrics, succeeded=False, message=f"{type(exc).__name__}: {exc}")
            except Exception:  # Redis itself may be what failed
                log.exception("could not record the failure in Redis")
        raise
    finally:
        close_gang(gang, finished=finished)
        if client is not None:
            client.close()


def _train(
    job: RLJob,
    gang: Gang,
    device: torch.device,
    client: redis.Redis | None,
    writer: MetricsWriter | None,
    metrics: TrainerMetrics,
    checkpoint_dir: str,
    progress: bool,
) -> None:
    """The gang's loop: rank 0's coordinator (it alone has `client` and `writer`) gathers each
    step's groups, every rank trains on its shard, rank 0 publishes and records; then everyone
    agrees on the new version."""
    grpo = job.spec.grpo
    torch.manual_seed(grpo.seed)
    random.seed(grpo.seed)
    trainer, resumed = prepare_trainer(job, gang, device, writer, checkpoint_dir, progress)
    start_step = resumed.step if resumed is not None else 0
    coordinator = None
    if client is not None and writer is not None:
        from rljob.trainer.coordinator import Coordinator

        coordinator = Coordinator(
            job,
            trainer,
            client=client,
            writer=writer,
            metrics=metrics,
            start_step=start_step,
            resumed=resumed is not None,
            progress=progress,
        )
    version = broadcast_object(gang, coordinator.version if coordinator else 0)
    for step in range(start_step, grpo.total_steps):
        batch = coordinator.gather(step) if coordinator else None
        groups = broadcast_object(gang, batch.groups if batch else None)
        stats = trainer.train_step(groups, version)
        if coordinator is not None and batch is not None:
            coordinator.finish(step, batch, stats)
        version = broadcast_object(gang, coordinator.version if coordinator else version)
        if gang.is_main and ((step + 1) % grpo.checkpoint_interval == 0 or step + 1 == grpo.total_steps):
            save_checkpoint(checkpoint_dir, step=step + 1, policy_version=version, trainer_state=trainer.state_dict())
    if coordinator is not None:
        coordinator.close()


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
    checkpoint volume) reads it itself; if any cannot, rank 0 sends the tensors one by one
    (`broadcast_state`). Nothing is pickled whole, and the loaded state is dropped once applied.
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
            writer.write_eval("warmup", asdict(result))
    control_barrier(gang)
    broadcast_parameters(gang, trainer.model)
    if trainer.ref_model is not None:
        trainer.ref_model.load_state_dict(trainer.model.state_dict())
