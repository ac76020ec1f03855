"""What the e2e modules share: kubectl helpers bound to a cluster, and the operator run from
source under the chart's ServiceAccount (so every test also proves the chart's RBAC)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from localcluster import wait_for
from operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "rljob"
OP_NS = "rljob-system"
SA = "rljob"
CHILD_KINDS = (
    "configmap",
    "secret",
    "service",
    "statefulset",
    "networkpolicy",
    "deployment",
    "job",
    "workloads.scheduling.k8s.io",
    "podgroups.scheduling.k8s.io",
)
TINY = yaml.safe_load((ROOT / "examples" / "rljob-tiny.yaml").read_text())
JOB_UID = "batch.kubernetes.io/controller-uid"


class Ops:
    """kubectl helpers bound to the cluster and the running operator."""

    def __init__(self, cluster, operator: OperatorProcess) -> None:
        self.cluster = cluster
        self.operator = operator

    def json(self, *args: str) -> Any:
        out = self.cluster.kubectl(*args, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def rljob(self, ns: str, name: str) -> dict[str, Any]:
        return self.json("get", "rljob", name, "-n", ns) or {}

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return self.rljob(ns, name).get("status", {})

    def wait_phase(self, ns: str, name: str, phase: str, timeout: float, what: str | None = None) -> None:
        """Wait until the RLJob's status says `phase` (the status, not its pods: a held update
        freezes the phase where it was)."""
        wait_for(lambda: self.status(ns, name).get("phase") == phase, timeout=timeout, what=what or phase)

    def condition(self, ns: str, name: str, ctype: str) -> dict[str, Any]:
        return next((c for c in self.status(ns, name).get("conditions", []) if c["type"] == ctype), {})

    def apply(self, ns: str, manifest: dict[str, Any], check: bool = True):
        return self.cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest), check=check)

    def pods(self, ns: str, role: str, name: str) -> list[dict[str, Any]]:
        out = self.json("get", "pods", "-n", ns, "-l", f"rljob.dev/job={name},rljob.dev/role={role}")
        return (out or {}).get("items", [])

    def running(self, ns: str, role: str, name: str, count: int) -> list[dict[str, Any]] | None:
        pods = [
            p
            for p in self.pods(ns, role, name)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]
        return pods if len(pods) == count else None

    def children(self, ns: str, name: str) -> list[dict[str, Any]]:
        out = self.json("get", ",".join(CHILD_KINDS), "-n", ns, "-l", f"rljob.dev/job={name}")
        items = [i for i in (out or {}).get("items", []) if i["kind"] != "Pod"]
        return [i for i in items if i["metadata"].get("ownerReferences", [{}])[0].get("kind") == "RLJob"]


def tracebacks(log: str) -> list[str]:
    """Each traceback in the operator's log, up to the next log record (lines start with `[`)."""
    return [part.split("\n[", 1)[0] for part in log.split("Traceback (most recent call last)")[1:]]


@contextmanager
def operator_session(
    cluster, log: Path, extra_env: dict[str, str] | None = None, provoked_error: str | None = None
) -> Iterator[Ops]:
    """The chart installed with replicaCount=0 and the operator running from source with its
    ServiceAccount's token; afterwards, no RBAC denial and no handler crash in its log (but the
    one error a test provokes on purpose)."""
    cluster.helm(
        "upgrade",
        "--install",
        "rljob",
        str(CHART),
        "-n",
        OP_NS,
        "--create-namespace",
        "--set",
        "replicaCount=0",
        "--wait",
    )
    kubeconfig = cluster.kubeconfig_for_serviceaccount(OP_NS, SA)
    # Deleted children are looked for every 2 s instead of every minute, so a test sees them back soon.
    operator = OperatorProcess(kubeconfig, log, extra_env={"RLJOB_CHILD_CHECK_SECONDS": "2", **(extra_env or {})})
    operator.start()
    try:
        yield Ops(cluster, operator)
    finally:
        operator.stop()
        print(operator.log_tail(3000))
    text = log.read_text(errors="replace")
    # An RBAC denial names the user; other 403s (a namespace being deleted) are not the chart's fault.
    denied = re.findall(rf'serviceaccount:{OP_NS}:{SA}\\?" cannot [^"\\]*', text)
    assert not denied, f"the chart's RBAC denied the operator: {sorted(set(denied))}"
    crashes = [tb for tb in tracebacks(text) if not provoked_error or provoked_error not in tb]
    assert not crashes, f"operator crashed in a handler:\n{crashes[-1][-4000:]}"


def tiny(name: str = "tiny", **spec: Any) -> dict[str, Any]:
    """examples/rljob-tiny.yaml (2 trainers on kwok GPU nodes) renamed, with `spec` merged in."""
    doc = json.loads(json.dumps(TINY))
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        if isinstance(value, dict):
            doc["spec"].setdefault(key, {}).update(value)
        else:
            doc["spec"][key] = value
    return doc


def fail_pod(ops: Ops, ns: str, pod: str) -> None:
    """A kwok pod "fails" as a kubelet reports it: its status phase set to Failed."""
    ops.cluster.kubectl(
        "patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p", '{"status":{"phase":"Failed"}}'
    )
