"""`rljob run FILE --local`: the cluster's job on one machine, through the pods' own code paths.

An embedded redis-server stands in for the managed one; rollout workers and trainer ranks are
child processes started with exactly the environment the operator renders into pods
(`rljob rollout`, `rljob train`). Every child is stopped on success, on error and on Ctrl-C, and
nothing outlives this process, even when it is killed outright (Linux).

Children are supervised as the cluster supervises pods: a rollout worker that dies is started
again (its held prompts are reclaimed, none lost or answered twice), a trainer that fails restarts
the whole gang from its last checkpoint (counted against `spec.restartLimit`, as the operator
counts gang restarts), and a redis-server that dies is restarted on its append-only file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rljob.config import RLJob
from rljob.embedded_redis import EmbeddedRedis
from rljob.parent_death import guarded
from rljob.plots import load_metrics
from rljob.ports import free_port
from rljob.runtime_env import WorkerEnv

# A worker or redis-server that keeps dying is broken, not unlucky: the run stops after this many.
PROCESS_RESTARTS = 5


class LocalRunFailed(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    def tail(self, chars: int = 3000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


@dataclass
class LocalRun:
    job: RLJob
    results_dir: Path
    rollout_workers: int = 1
    children: list[Child] = field(default_factory=list)
    redis_restarts: int = 0

    def _spawn(self, name: str, args: list[str], env: dict[str, str], to_console: bool) -> Child:
        log_path = None if to_console else self.results_dir / "logs" / f"{name}.log"
        child = Child(name, self._start(args, env, log_path), log_path, args, env)
        self.children.append(child)
        return child

    def _start(self, args: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
        if log_path:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        else:
            out = None
        # Workers and trainers take turns on the same cores: idle OpenMP threads must sleep, not spin.
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **env}
        # A parent killed outright (kill -9, the OOM killer) cannot stop its children: they are
        # killed with it (rljob.parent_death), as nothing is left to read their work or to serve Redis.
        process = subprocess.Popen(
            guarded([sys.executable, "-m", "rljob.cli", *args], signal.SIGKILL),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        if out:
            out.close()
        return process

    def _restart(self, child: Child) -> None:
        child.restarts += 1
        child.process = self._start(child.args, child.env, child.log_path)

    def run(self) -> int:
        """Run to completion; returns the trainer's exit code (0 on success)."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.results_dir / "job.yaml"
        config_path.write_text(yaml.safe_dump(self.job.model_dump(by_alias=True, mode="json"), sort_keys=False))
        redis = EmbeddedRedis(
            self.results_dir / "redis", appendonly=True, password=secrets.token_hex(16), die_with_parent=True
        )
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        # Ctrl-C stops the run even where SIGINT came in ignored: a shell starts background jobs
        # (`rljob run ... &`, nohup, some CI runners) with SIGINT ignored, and Python then keeps it so.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupted = False
        try:
            redis.start()  # inside the try: an interrupt right after it still stops it
            print(f"[rljob] embedded redis-server on 127.0.0.1:{redis.port}; results in {self.results_dir}", flush=True)
            base = WorkerEnv(
                config_path=str(config_path),
                redis_url=f"redis://127.0.0.1:{redis.port}/0",
                redis_password=redis.password,
                checkpoint_dir=str(self.results_dir / "checkpoints"),
                results_dir=str(self.results_dir),
                worker_id="local",
            )
            for i in range(self.rollout_workers):
                env = base.model_copy(update={"worker_id": f"rollout-{i}"}).to_environ()
                self._spawn(f"rollout-{i}", ["rollout"], env, to_console=False)
            world = self.job.spec.trainer.replicas
            port = free_port()
            trainers = []
            for rank in range(world):
                env = base.model_copy(update={"worker_id": f"trainer-{rank}"}).to_environ()
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
                trainers.append(self._spawn(f"trainer-{rank}", ["train"], env, to_console=rank == 0))
            return self._supervise(trainers, redis)
        except KeyboardInterrupt:
            interrupted = True
            print("\n[rljob] interrupted: stopping workers and trainers", file=sys.stderr, flush=True)
            return 130
        finally:
            self._shut_down(redis)
            # An interrupted run is on its way out with 130: a Ctrl-C pressed again after the
            # shutdown must not turn that into death by SIGINT.
            signal.signal(signal.SIGTERM, signal.SIG_IGN if interrupted else previous)
            signal.signal(signal.SIGINT, signal.SIG_IGN if interrupted else previous_int)

    def _shut_down(self, redis: EmbeddedRedis) -> None:
        """Stop the children, then redis-server, whatever arrives meanwhile. Every child runs in a
        session of its own, out of the terminal's reach, so a step skipped here is a process left
        running for good. A rollout worker finishes its batch before it exits (minutes on CPU), so
        a second Ctrl-C is likely: it hurries the shutdown (SIGKILL now) instead of cutting it short."""
        try:
            try:
                self.stop_children()
            except KeyboardInterrupt:
                _warn("interrupted again: killing workers and trainers now")
                with _signals_ignored():
                    self.stop_children(grace=0.0)
        finally:
            with _signals_ignored():
                redis.stop()

    def _supervise(self, trainers: list[Child], redis: EmbeddedRedis) -> int:
        gang_restarts = 0
        while True:
            if not redis.running():
                self.redis_restarts += 1
                if self.redis_restarts > PROCESS_RESTARTS:
                    raise LocalRunFailed(
                        f"redis-server died {self.redis_restarts} times (log: {redis.workdir / 'redis.log'})"
                    )
                _warn(f"redis-server died; restarting it on its append-only file (restart {self.redis_restarts})")
                redis.restart()
            codes = {t.name: t.process.poll() for t in trainers}
            if all(code == 0 for code in codes.values()):
                return 0
            failed = next((t for t in trainers if codes[t.name] not in (None, 0)), None)
            if failed is not None:
                code = codes[failed.name]
                if gang_restarts >= self.job.spec.restart_limit:
                    raise LocalRunFailed(self._failure(failed, code, f"restartLimit {self.job.spec.restart_limit}"))
                gang_restarts += 1
                _warn(
                    f"{failed.name} exited with code {code}; restarting the trainers from their "
                    f"last checkpoint (gang restart {gang_restarts} of {self.job.spec.restart_limit})"
                )
                self.stop_children(grace=20.0, only=trainers)
                port = str(free_port())  # the last gang's store may still hold its port
                for t in trainers:
                    t.env["MASTER_PORT"] = port
                    self._restart(t)
            for child in self.children:
                code = child.process.poll()
                if child in trainers or code is None:
                    continue
                if child.restarts >= PROCESS_RESTARTS:
                    raise LocalRunFailed(self._failure(child, code, f"{PROCESS_RESTARTS} restarts"))
                _warn(f"{child.name} exited with code {code}; starting it again (its prompts are reclaimed, none lost)")
                self._restart(child)
            time.sleep(0.5)

    @staticmethod
    def _failure(child: Child, code: int | None, limit: str) -> str:
        where = f" (log: {child.log_path})" if child.log_path else ""
        return f"{child.name} exited with code {code}, past {limit}{where}\n{child.tail()}"

    def stop_children(self, grace: float = 20.0, only: list[Child] | None = None) -> None:
        children = self.children if only is None else only
        for child in children:
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait(timeout=10)


def _warn(message: str) -> None:
    print(f"[rljob] {message}", file=sys.stderr, flush=True)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block (the last steps of a shutdown must not be cut)."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def summarise(results_dir: Path) -> dict[str, object]:
    """The trainer's metrics.jsonl and eval files, read into what `rljob.cli.closing_lines` shows."""
    trained = [r for r in load_metrics(results_dir) if r.get("step_seconds")]
    rewards = [r.get("mean_reward", 0.0) for r in trained]
    summary: dict[str, object] = {"results_dir": str(results_dir), "steps_trained": len(trained), "rewards": rewards}
    for name in ("warmup.json", "eval_before.json", "eval_after.json"):
        path = results_dir / name
        if path.exists():
            summary[name.removesuffix(".json")] = json.loads(path.read_text())
    return summary
