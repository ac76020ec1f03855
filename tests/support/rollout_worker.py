"""`python -m support.rollout_worker --job job.yaml --redis-url ... --worker-id ...`: one rollout worker
whose claim and heartbeat timings a test can shorten (pods run `rljob rollout`, configured by RLJOB_*)."""

from __future__ import annotations

import argparse
import logging

from rljob.config import load_rljob
from rljob.rollout.worker import run_rollout_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="RLJob manifest (YAML)")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--device", default=None)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--claim-min-idle-ms", type=int, default=30_000)
    parser.add_argument("--heartbeat-seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run_rollout_worker(
        load_rljob(args.job),
        args.redis_url,
        args.worker_id,
        device=args.device,
        metrics_port=args.metrics_port,
        claim_min_idle_ms=args.claim_min_idle_ms,
        heartbeat_seconds=args.heartbeat_seconds,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
