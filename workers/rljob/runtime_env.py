"""What a worker process learns from its environment: the contract between pods and code.

The operator renders these variables into the rollout Deployment and the trainer gang; the local
runtime sets the same ones for its child processes, so both paths run the same code.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, Field

from rljob.assets import hotpotqa_file, smollm2_model_dir
from rljob.config import RLJob

BUNDLED_MODEL = "bundled:smollm2-135m-instruct"


class WorkerEnv(BaseModel):
    """Process settings shared by `rljob rollout` and `rljob train`."""

    config_path: str = Field(description="The RLJob manifest (the job ConfigMap's job.yaml).")
    redis_url: str = Field(description="Redis URL without the password.")
    redis_password: str | None = None
    checkpoint_dir: str = "/checkpoints"
    results_dir: str | None = None
    worker_id: str = Field(default_factory=socket.gethostname)

    # Each field's variable: the only place these names are written (the operator's renderer reads them here).
    NAMES: ClassVar[dict[str, str]] = {
        "config_path": "RLJOB_CONFIG",
        "redis_url": "RLJOB_REDIS_URL",
        "redis_password": "RLJOB_REDIS_PASSWORD",
        "checkpoint_dir": "RLJOB_CHECKPOINT_DIR",
        "results_dir": "RLJOB_RESULTS_DIR",
        "worker_id": "RLJOB_WORKER_ID",
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("config_path", "redis_url")

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        missing = [cls.NAMES[f] for f in cls.REQUIRED if not env.get(cls.NAMES[f])]
        if missing:
            raise SystemExit(f"missing environment variable(s): {', '.join(missing)}")
        given = {f: env[name] for f, name in cls.NAMES.items() if env.get(name)}
        given.setdefault("worker_id", env.get("HOSTNAME") or socket.gethostname())
        return cls(**given)

    def to_environ(self) -> dict[str, str]:
        values = self.model_dump()
        return {name: str(values[f]) for f, name in self.NAMES.items() if values[f]}

    @property
    def authenticated_redis_url(self) -> str:
        """The URL with the password in it; never log this."""
        if not self.redis_password:
            return self.redis_url
        return with_password(self.redis_url, self.redis_password)


def with_password(url: str, password: str) -> str:
    """`url` with `password` (percent-encoded) as its password, everything else as written.

    The host and port are copied verbatim rather than rebuilt from the parsed host name, so an ACL
    user name (`rediss://rljob@host`) still authenticates as that user and a bracketed IPv6 host
    (`redis://[fd00::1]:6379`) stays parsable; scheme, database path and query are kept too.
    """
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""  # still percent-encoded, as redis-py expects
    netloc = f"{user}:{quote(password, safe='')}@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def resolve_bundled(job: RLJob) -> RLJob:
    """Turn `bundled:` model names and relative bundled data paths into real paths.

    A manifest for a local run says `model.name: bundled:smollm2-135m-instruct` and
    `data.source: path` with paths like `bundled:train.jsonl`; in a cluster the same fields hold a
    hub name and volume paths, which pass through unchanged.
    """
    spec = job.spec.model_copy(deep=True)
    if spec.model.name == BUNDLED_MODEL:
        spec.model.name, spec.model.gguf_file = str(smollm2_model_dir()), None
    elif spec.model.name.startswith(("/", "./", "../", "~")) and not Path(spec.model.name).expanduser().exists():
        raise FileNotFoundError(
            f"spec.model.name: {spec.model.name} does not exist (pass a model directory or .gguf file, or "
            f"{BUNDLED_MODEL} for the bundled SmolLM2-135M-Instruct)"
        )
    for attr in ("train_path", "eval_path"):
        value = getattr(spec.data, attr)
        if value.startswith("bundled:"):
            try:
                path = hotpotqa_file(value.removeprefix("bundled:"))
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"spec.data.{attr}: {exc}") from None
            setattr(spec.data, attr, str(path))
        elif spec.data.source == "path" and not Path(value).exists():
            raise FileNotFoundError(
                f"spec.data.{attr}: {value} does not exist (pass a path to HotpotQA JSON/JSONL, or "
                "use bundled:train.jsonl / bundled:dev.jsonl for the HotpotQA sample that ships with rljob)"
            )
    return job.model_copy(update={"spec": spec})
