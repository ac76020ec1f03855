"""Names and labels of an RLJob's children, in one place (stable across restarts)."""

from __future__ import annotations

from dataclasses import dataclass

from rljob.config import API_GROUP

LABEL_JOB = f"{API_GROUP}/job"
LABEL_ROLE = f"{API_GROUP}/role"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
ANNOTATION_TRAINER_HASH = f"{API_GROUP}/trainer-hash"
FIELD_MANAGER = "rljob-operator"
REDIS_PORT = 6379
TRAINER_PORT = 29500


@dataclass(frozen=True)
class ChildNames:
    """Every child is named after its RLJob, so a restarted operator finds (never duplicates) them."""

    job: str
    namespace: str

    @property
    def config(self) -> str:
        return f"{self.job}-config"

    @property
    def redis(self) -> str:
        return f"{self.job}-redis"

    @property
    def redis_secret(self) -> str:
        return f"{self.job}-redis"

    @property
    def rollout(self) -> str:
        return f"{self.job}-rollout"

    @property
    def trainer(self) -> str:
        return f"{self.job}-trainer"

    @property
    def master_addr(self) -> str:
        # Indexed Job pods get hostname <job>-<index> under the headless Service's subdomain.
        return f"{self.trainer}-0.{self.trainer}.{self.namespace}.svc"

    @property
    def managed_redis_url(self) -> str:
        return f"redis://{self.redis}.{self.namespace}.svc:{REDIS_PORT}/0"


def labels(job: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rljob",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        LABEL_JOB: job,
        LABEL_ROLE: role,
    }


def selector(job: str, role: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: role}
