"""An in-process toy environment for the trainer: sample from a (tiny) model, reward a target token.

It produces real `TrajectoryGroup`s, including an injected stretch of tokens in the middle that is
masked out of the loss (as retrieved passages are), so the learning-sanity test, the resume test and
the gang test drive the very `GRPOTrainer.train_step` the Redis loop uses.
"""

from __future__ import annotations

import sys

import torch

from rljob.protocol import Trajectory, TrajectoryGroup


@torch.no_grad()
def sample_toy_groups(
    model: torch.nn.Module,
    *,
    step: int,
    questions: int,
    group_size: int,
    policy_version: int,
    target_tokens: tuple[int, ...] = (5,),
    prompt_length: int = 4,
    new_tokens: tuple[int, int] = (4, 4),
    injected: tuple[int, ...] = (3, 4),
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> list[TrajectoryGroup]:
    """`questions` groups of `group_size` samples; reward = fraction of generated tokens in targets.

    Each sample: a random prompt (shared within a group), `new_tokens[0]` sampled tokens, the
    `injected` tokens (loss-masked), then `new_tokens[1]` sampled tokens. Uses the global torch RNG
    unless a generator is given, so checkpointed RNG state reproduces the samples.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    vocab = vocab_limit or model.config.vocab_size
    targets = set(target_tokens)
    groups = []
    for q in range(questions):
        prompt = torch.randint(3, vocab, (prompt_length,), generator=generator)
        ids = prompt.unsqueeze(0).repeat(group_size, 1).to(device)
        mask = [[0] * prompt_length for _ in range(group_size)]
        logps: list[list[float]] = [[0.0] * prompt_length for _ in range(group_size)]
        for part, count in enumerate(new_tokens):
            for _ in range(count):
                logits = model(input_ids=ids).logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1)
                nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(device)
                chosen = logp.gather(-1, nxt).squeeze(-1).tolist()
                ids = torch.cat([ids, nxt], dim=1)
                for i in range(group_size):
                    mask[i].append(1)
                    logps[i].append(chosen[i])
            if part == 0 and injected:
                inj = torch.tensor(injected, device=device).unsqueeze(0).repeat(group_size, 1)
                ids = torch.cat([ids, inj], dim=1)
                for i in range(group_size):
                    mask[i].extend([0] * len(injected))
                    logps[i].extend([0.0] * len(injected))
        trajectories = []
        for i in range(group_size):
            row = ids[i].tolist()
            generated = [t for t, m in zip(row, mask[i], strict=True) if m]
            reward = sum(t in targets for t in generated) / len(generated)
            trajectories.append(
                Trajectory(
                    token_ids=row,
                    prompt_length=prompt_length,
                    loss_mask=mask[i],
                    behaviour_logprobs=logps[i],
                    policy_version=policy_version,
                    reward=reward,
                    exact_match=float(reward == 1.0),
                    f1=reward,
                    format_ok=True,
                )
            )
        groups.append(
            TrajectoryGroup(
                request_id=f"toy-{step}-{q}",
                step=step,
                question_id=f"toy-{q}",
                worker_id="toy",
                trajectories=trajectories,
            )
        )
    model.train(was_training)
    return groups


def mean_reward(groups: list[TrajectoryGroup]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / max(len(rewards), 1)


def run_toy_training(
    *,
    steps: int,
    out: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    seed: int = 0,
    spec_overrides: dict | None = None,
    record_grads: bool = False,
    target_tokens: tuple[int, ...] = tuple(range(3, 11)),
    progress: bool = False,
) -> dict:
    """The GRPO step loop on the toy environment, with the gang, checkpoints and resume of the real one.

    Every rank joins the gang from the environment; rank 0 samples each step's groups and hands
    them to the others, as the Redis loop does. Returns (and on rank 0 saves to `out`) the final
    weights, the per-step mean rewards and, if asked, each step's synced gradient.
    """
    from rljob.config import GRPOSpec
    from rljob.trainer.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
    from rljob.trainer.distributed import broadcast_object, broadcast_parameters, close_gang, init_gang
    from rljob.trainer.grpo import GRPOTrainer
    from support.tiny_models import tiny_causal_lm

    device = torch.device("cpu")
    gang = init_gang(device)
    spec = GRPOSpec(
        **{
            "group_size": 4,
            "questions_per_step": 2,
            "learning_rate": 1e-2,
            "micro_batch_size": 3,
            "seed": seed,
            **(spec_overrides or {}),
        }
    )
    torch.manual_seed(spec.seed)
    model = tiny_causal_lm(32, seed=spec.seed)
    broadcast_parameters(gang, model)
    trainer = GRPOTrainer(model, None, spec, device, gang=gang)
    grads: list[torch.Tensor] = []
    if record_grads:
        original = trainer.optimizer.step

        def step_and_record(*args, **kwargs):
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in trainer.params]))
            return original(*args, **kwargs)

        trainer.optimizer.step = step_and_record
    start, version = 0, 0
    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if latest is not None:
        ckpt = load_checkpoint(latest)
        trainer.load_state_dict(ckpt.trainer)
        restore_rng(ckpt.rng)
        start, version = ckpt.step, ckpt.policy_version
    rewards = []
    for step in range(start, steps):
        groups = None
        if gang.is_main:
            groups = sample_toy_groups(
                trainer.model,
                step=step,
                questions=spec.questions_per_step,
                group_size=spec.group_size,
                policy_version=version,
                target_tokens=target_tokens,
            )
        groups = broadcast_object(gang, groups)
        rewards.append(mean_reward(groups))
        trainer.train_step(groups, version)
        version += 1
        if progress:
            print(f"rank {gang.rank} step {step + 1}/{steps} reward {rewards[-1]:.3f}", file=sys.stderr, flush=True)
        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0 and gang.is_main:
            save_checkpoint(checkpoint_dir, step=step + 1, policy_version=version, trainer_state=trainer.state_dict())
    result = {
        "params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]),
        "rewards": rewards,
        "grads": grads,
        "version": version,
    }
    if out and gang.is_main:
        torch.save(result, out)
    close_gang(gang, finished=True)
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="GRPO on a toy reward with a tiny model (tests, demos).")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--spec", default="{}", help="JSON overrides of GRPOSpec fields")
    parser.add_argument("--record-grads", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_toy_training(
        steps=args.steps,
        out=args.out,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        spec_overrides=json.loads(args.spec),
        record_grads=args.record_grads,
        progress=True,
    )
    print(json.dumps({"rewards": result["rewards"], "version": result["version"]}))


if __name__ == "__main__":
    main()
