"""What a restarted trainer must reproduce: the question order, and the KL reference it trained against."""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import pytest
import torch

from rljob.config import RLJob
from rljob.trainer import loop
from rljob.trainer.checkpoint import (
    REFERENCE_FILE,
    STATE_FILE,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    save_reference,
)
from rljob.trainer.distributed import Gang
from rljob.trainer.grpo import GRPOTrainer
from rljob.trainer.loop import prepare_trainer
from rljob.trainer.prompts import epoch_order, question_indices
from support.tiny_models import tiny_causal_lm
from support.toy import sample_toy_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference_indices(step: int, per_step: int, total: int, seed: int) -> list[int]:
    """The original definition (one full shuffle per slot), kept as the specification."""
    out = []
    for slot in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(slot, total)
        order = list(range(total))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[pos])
    return out


@pytest.mark.parametrize(("per_step", "total", "seed"), [(4, 10, 0), (3, 7, 5), (8, 5, 1), (1, 1, 2)])
def test_question_indices_keep_the_original_sequence(per_step: int, total: int, seed: int) -> None:
    for step in range(12):  # several epochs, steps straddling them, and per_step > total
        assert question_indices(step, per_step, total, seed) == _reference_indices(step, per_step, total, seed)


def test_every_epoch_covers_each_question_once() -> None:
    total, per_step = 12, 4
    for epoch in range(3):
        seen = [i for step in range(epoch * 3, epoch * 3 + 3) for i in question_indices(step, per_step, total, 7)]
        assert sorted(seen) == list(range(total))
    assert question_indices(0, per_step, total, 7) != question_indices(3, per_step, total, 7)  # reshuffled


def test_a_step_shuffles_once_per_epoch_not_once_per_question(monkeypatch) -> None:
    """The cost per step must not be questions_per_step full shuffles of the training set."""
    calls = []
    shuffle = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: (calls.append(len(x)), shuffle(self, x))[1])
    for total in (1_000, 20_000):
        epoch_order.cache_clear()
        calls.clear()
        for _ in range(2):  # the trainer asks for every step twice (enqueue, then collect)
            for step in range(10):
                question_indices(step, 64, total, 0)
        assert calls == [total], total  # 1,280 slots, all in epoch 0: one shuffle
    epoch_order.cache_clear()
    calls.clear()
    question_indices(1, 64, 100, 0)  # slots 64..127 straddle epochs 0 and 1
    assert calls == [100, 100]


# -- the KL reference across a restart ------------------------------------------------------------

VOCAB = 32


def _job(warmup: bool = True) -> RLJob:
    return RLJob.model_validate(
        {
            "spec": {
                "grpo": {
                    "klCoef": 0.1,
                    "groupSize": 4,
                    "questionsPerStep": 2,
                    "learningRate": 1e-2,
                    "microBatchSize": 8,
                },
                "warmup": {"enabled": warmup},
            }
        }
    )


def _base() -> torch.nn.Module:
    """What `load_policy_model` returns in every process, the first and every restarted one."""
    return tiny_causal_lm(VOCAB, seed=1)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def fake_startup(monkeypatch):
    """A tiny base model, and a warm-up that moves the weights the way SFT would (and counts runs)."""
    runs = []

    def warmup_for_job(job, model, device, progress, autocast_dtype=None):
        runs.append(1)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(len(runs))
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        return SimpleNamespace(examples=1, steps=1, first_loss=1.0, last_loss=0.5, seconds=0.0)

    import rljob.warmup

    monkeypatch.setattr(loop, "load_policy_model", lambda job: _base())
    monkeypatch.setattr(rljob.warmup, "warmup_for_job", warmup_for_job)
    rng = capture_rng()
    yield runs
    restore_rng(rng)


def _train_one_step(trainer) -> None:
    groups = sample_toy_groups(
        trainer.model,
        step=0,
        questions=2,
        group_size=4,
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
        target_tokens=(5,),
    )
    for g in groups:  # every group informative
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2) + 0.1 * i
    assert trainer.train_step(groups, 0).updated


def _start(job: RLJob, directory) -> tuple:
    return prepare_trainer(job, Gang(), torch.device("cpu"), None, str(directory), progress=False)


def test_resume_keeps_the_warmed_up_kl_reference(tmp_path, fake_startup) -> None:
    job = _job()
    trainer, ckpt = _start(job, tmp_path)
    assert ckpt is None and fake_startup == [1]
    warmed = _state(trainer.model)
    assert _same(_state(trainer.ref_model), warmed) and not _same(warmed, _state(_base()))
    assert (tmp_path / REFERENCE_FILE).exists() and not list(tmp_path.glob(".tmp-*"))

    _train_one_step(trainer)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer_state=trainer.state_dict())
    policy = _state(trainer.model)

    restarted, ckpt = _start(job, tmp_path)  # a new process: fresh base weights, then the checkpoint
    assert ckpt is not None and ckpt.step == 1 and fake_startup == [1]  # no second warm-up
    assert _same(_state(restarted.model), policy)
    assert _same(_state(restarted.ref_model), warmed)  # not the base model the process loaded


def test_a_fresh_start_discards_an_earlier_runs_reference(tmp_path, fake_startup, caplog) -> None:
    save_reference(tmp_path, tiny_causal_lm(VOCAB, seed=9).state_dict())  # left by a deleted job of this name
    job = _job(warmup=False)
    trainer, _ = _start(job, tmp_path)
    assert not (tmp_path / REFERENCE_FILE).exists() and fake_startup == []
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer_state=trainer.state_dict())

    restarted, _ = _start(job, tmp_path)
    assert _same(_state(restarted.ref_model), _state(_base()))

    # A warmed-up run's checkpoint without its reference (written before references were saved): warn.
    with caplog.at_level("WARNING", logger=loop.__name__):
        restarted, _ = _start(_job(warmup=True), tmp_path)
    assert REFERENCE_FILE in caplog.text and _same(_state(restarted.ref_model), _state(_base()))


# -- reading a checkpoint mapped (a GPU trainer's resume) -----------------------------------------


def _mapped_files(name: str) -> list[str]:
    with open("/proc/self/maps") as fh:
        return [line for line in fh if line.rstrip().endswith(name)]


def test_a_mapped_checkpoint_loads_the_same_and_is_unmapped_once_applied(tmp_path) -> None:
    """A GPU trainer reads its checkpoint mapped; no tensor of the trainer may keep the file mapped
    (AdamW's step counts stay on the CPU as loaded), or it stays on disk after retention deletes it."""
    trainer = GRPOTrainer(_base(), None, _job().spec.grpo)
    _train_one_step(trainer)
    path = save_checkpoint(tmp_path, step=1, policy_version=1, trainer_state=trainer.state_dict())
    plain = load_checkpoint(path).trainer
    mapped = load_checkpoint(path, mmap=True).trainer
    assert _same(mapped["model"], plain["model"]) and _mapped_files(STATE_FILE)
    assert _same(mapped["optimizer"]["state"][0], plain["optimizer"]["state"][0])

    restarted = GRPOTrainer(_base(), None, _job().spec.grpo)
    restarted.load_state_dict(mapped)
    del mapped
    gc.collect()
    assert _mapped_files(STATE_FILE)  # the optimiser holds loaded tensors
    loop.own_cpu_tensors(restarted.optimizer)
    gc.collect()
    assert not _mapped_files(STATE_FILE)
    assert _same(restarted.optimizer.state_dict()["state"][0], plain["optimizer"]["state"][0])
