"""The Redis key space of one job, in one place.

Every key lives under `rljob:{namespace}/{name}:` so jobs sharing a Redis never collide. The
braces also make it a Redis Cluster hash tag, keeping one job's keys on one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT_GROUP = "rollout"  # consumer group on the prompt stream; its lag drives autoscaling
TRAINER_GROUP = "trainer"  # consumer group on the trajectory stream


@dataclass(frozen=True)
class JobKeys:
    namespace: str
    name: str

    @property
    def prefix(self) -> str:
        return f"rljob:{{{self.namespace}/{self.name}}}:"

    @property
    def prompts(self) -> str:
        """Stream of prompt requests (one entry = one question to sample G times)."""
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        """Stream of finished trajectory groups."""
        return self.prefix + "trajectories"

    @property
    def eval_prompts(self) -> str:
        return self.prefix + "eval:prompts"

    @property
    def eval_results(self) -> str:
        return self.prefix + "eval:results"

    @property
    def metrics(self) -> str:
        """Hash of the latest trainer metrics, read by the operator into RLJob status."""
        return self.prefix + "metrics"

    @property
    def weights_latest(self) -> str:
        return self.prefix + "weights:latest"

    @property
    def weights_latest_id(self) -> str:
        """The publish id of `weights_latest`'s version (a number alone can name two versions)."""
        return self.prefix + "weights:latest_id"

    @property
    def weights_versions(self) -> str:
        """Sorted set of retained versions (score = version)."""
        return self.prefix + "weights:versions"

    @property
    def weights_events(self) -> str:
        """Pub/sub channel announcing each new version."""
        return self.prefix + "weights:events"

    def weights_manifest(self, version: int) -> str:
        return f"{self.prefix}weights:v{version}:manifest"

    def weights_chunk(self, version: int, index: int, attempt: str) -> str:
        """Chunk `index` of version `version`; `attempt` (a publish's random id) keeps two
        publishers of the same number from overwriting each other's chunks."""
        return f"{self.prefix}weights:v{version}:{attempt}:chunk:{index}"

    @property
    def weights_rebase(self) -> str:
        """Set by a reader that cannot apply a stored version (corrupt/lost chunk): publish a full next."""
        return self.prefix + "weights:rebase"

    @property
    def rollout_done(self) -> str:
        """Set of prompt request ids whose group is already published (dedupes redeliveries)."""
        return self.prefix + "rollout:done"

    @property
    def workers(self) -> str:
        """Hash worker-id -> heartbeat JSON (busy flag, weight version)."""
        return self.prefix + "workers"
