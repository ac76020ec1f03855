"""Operator benchmark on the real control plane: apply N RLJobs at once, measure the time until
every child exists and every trainer pod is Running, and the Kubernetes API calls per reconcile.

Two operators side by side on the same cluster: `rljob` (applies children on spec changes, then its
timer only observes and patches what changed) and a `naive` baseline (the same code re-applying
every child on every timer pass, what a simple level-triggered operator does). Ratios are
naive / rljob.

    python benchmarks/bench_operator.py --quick     # 10 jobs, short steady-state window
    python benchmarks/bench_operator.py             # 50 jobs, 30 s steady-state window

Progress lines on stderr-like stdout; the JSON summary is the LAST line of stdout; results go to
docs/results/bench_operator.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e" / "cluster"))

from localcluster import LocalCluster, build_binaries  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

CHILDREN_PER_JOB = 10  # ConfigMap, Secret, 2 Services, StatefulSet, NetworkPolicy, Deployment, Job, Workload, PodGroup
KINDS = "configmaps,secrets,services,statefulsets,networkpolicies,deployments,jobs,workloads,podgroups"


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def job_manifest(i: int) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "rljob-tiny.yaml").read_text())
    doc["metadata"]["name"] = f"bench-{i:03d}"
    small = {"cpu": "100m", "memory": "256Mi"}
    doc["spec"]["rollout"]["resources"] = small
    doc["spec"]["trainer"]["resources"] = small
    doc["spec"]["weightSync"]["redis"]["memory"] = "128Mi"
    return doc


def count(cluster: LocalCluster, ns: str, what: str, selector: str, phase: str | None = None) -> int:
    args = ["get", what, "-n", ns, "-l", selector, "-o", "json"]
    items = json.loads(cluster.kubectl(*args).stdout)["items"]
    if phase:
        items = [i for i in items if i.get("status", {}).get("phase") == phase]
    return len(items)


def api_totals(op: OperatorProcess) -> tuple[float, float, float]:
    m = op.metrics()
    calls = sum(v for k, v in m.items() if k.startswith("rljob_operator_api_calls_total{"))
    full = m.get('rljob_operator_reconciles_total{kind="full"}', 0.0)
    timer = m.get('rljob_operator_reconciles_total{kind="timer"}', 0.0)
    return calls, full, timer


def run_mode(
    cluster: LocalCluster, kubeconfig: Path, mode: str, jobs: int, window: float, workdir: Path, timeout: float
) -> dict[str, Any]:
    ns = f"bench-{mode}"
    cluster.kubectl("create", "namespace", ns)
    extra = {"RLJOB_ALWAYS_FULL": "1"} if mode == "naive" else {}
    # Each operator watches only its own namespace, so the modes never see each other's jobs.
    op = OperatorProcess(
        kubeconfig, workdir / f"operator-{mode}.log", timer_interval=2.0, extra_env=extra, args=[f"--namespace={ns}"]
    ).start()
    try:
        manifests = {"apiVersion": "v1", "kind": "List", "items": [job_manifest(i) for i in range(jobs)]}
        start = time.monotonic()
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(manifests))
        apply_s = time.monotonic() - start
        progress(f"{mode}: applied {jobs} RLJobs in {apply_s:.2f}s")
        want = jobs * CHILDREN_PER_JOB
        children_s = pods_s = None
        while time.monotonic() - start < timeout:
            if children_s is None:
                have = count(cluster, ns, KINDS, "app.kubernetes.io/managed-by=rljob-operator")
                if have >= want:
                    children_s = time.monotonic() - start
                    create_calls, create_full, create_timer = api_totals(op)
                    progress(f"{mode}: all {want} children exist after {children_s:.2f}s")
            else:
                running = count(cluster, ns, "pods", "rljob.dev/role=trainer", phase="Running")
                if running >= 2 * jobs:
                    pods_s = time.monotonic() - start
                    progress(f"{mode}: all {2 * jobs} trainer pods Running after {pods_s:.2f}s")
                    break
            time.sleep(0.5)
        if children_s is None or pods_s is None:
            raise RuntimeError(f"{mode}: not converged in {timeout}s\n{op.log_tail()}")
        c0, f0, t0 = api_totals(op)
        time.sleep(window)
        c1, f1, t1 = api_totals(op)
        steady_calls = (c1 - c0) / max(t1 - t0 + f1 - f0, 1.0)
        progress(f"{mode}: steady state {steady_calls:.2f} API calls per reconcile over {t1 - t0:.0f} timer passes")
        return {
            "jobs": jobs,
            "seconds_kubectl_apply": round(apply_s, 3),
            "seconds_to_all_children": round(children_s, 3),
            "seconds_to_all_trainers_running": round(pods_s, 3),
            "api_calls_per_job_until_children": round(create_calls / jobs, 2),
            "reconciles_until_children": {"full": create_full, "timer": create_timer},
            "api_calls_per_steady_reconcile": round(steady_calls, 2),
        }
    finally:
        op.stop()  # the jobs stay (the cluster is torn down at the end); the next mode has its own namespace


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("seconds_to_all_children", "s to all children"),
        ("seconds_to_all_trainers_running", "s to all trainers Running"),
        ("api_calls_per_steady_reconcile", "API calls / steady reconcile"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(12, 3.5))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        modes = list(results)
        ax.bar(modes, [results[m][key] for m in modes], color=["tab:blue", "tab:gray"])
        ax.set_title(label)
    fig.suptitle(f"rljob operator, {results['rljob']['jobs']} RLJobs on a kwok control plane")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 jobs and a short window (about a minute of runs)")
    parser.add_argument("--jobs", type=int, default=None, help="RLJobs applied at once (default 50, quick 10)")
    parser.add_argument("--window", type=float, default=None, help="steady-state seconds per mode")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    window = args.window if args.window is not None else (4.0 if args.quick else 30.0)
    args.jobs = args.jobs or (10 if args.quick else 50)

    bin_dir = build_binaries()
    cluster = LocalCluster(bin_dir)
    wall = time.monotonic()
    try:
        cluster.start()
        progress("cluster up; installing the chart (replicaCount=0)")
        cluster.helm(
            "upgrade",
            "--install",
            "rljob",
            str(ROOT / "charts" / "rljob"),
            "-n",
            "rljob-system",
            "--create-namespace",
            "--set",
            "replicaCount=0",
            "--wait",
        )
        kubeconfig = cluster.kubeconfig_for_serviceaccount("rljob-system", "rljob")
        workdir = Path(tempfile.mkdtemp(prefix="rljob-bench-"))
        results = {
            mode: run_mode(cluster, kubeconfig, mode, args.jobs, window, workdir, timeout=240)
            for mode in ("rljob", "naive")
        }
    finally:
        cluster.stop()
    ours, base = results["rljob"], results["naive"]
    summary = {
        "benchmark": "bench_operator",
        "quick": args.quick,
        "jobs": args.jobs,
        "steady_window_s": window,
        "rljob": ours,
        "naive": base,
        "ratios_naive_over_rljob": {
            key: round(base[key] / ours[key], 2) if ours[key] else None
            for key in (
                "seconds_to_all_children",
                "seconds_to_all_trainers_running",
                "api_calls_per_steady_reconcile",
                "api_calls_per_job_until_children",
            )
        },
        "wall_seconds": round(time.monotonic() - wall, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (args.out / f"bench_operator{suffix}.json").write_text(json.dumps(summary, indent=2))
    plot({"rljob": ours, "naive": base}, args.out / f"bench_operator{suffix}.png")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
