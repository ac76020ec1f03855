"""Kueue's manager beside the e2e control plane, as a platform team installs it, minus the Deployment.

build.sh builds the manager from its pinned Go module and writes the module's own CRDs and
webhook configurations (`kueue-manifests.yaml`). This installs the CRDs, points the webhooks at the
manager on a loopback port (a `url` with a serving certificate for 127.0.0.1 signed by the
cluster's CA, since the API server cannot reach a Service without kube-proxy) and runs the manager
with the cluster's admin credentials. Only the integrations rljob needs are switched on (batch/job,
pod, deployment); their webhooks act only in namespaces labelled `QUEUED_NAMESPACE_LABEL`, so the
other tests' namespaces never depend on Kueue being up.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from localcluster import LocalCluster, issue_cert, log, wait_for
from rljob.ports import free_port

KUEUE_NAMESPACE = "kueue-system"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
QUEUED_NAMESPACE_LABEL = {"rljob.dev/e2e-kueue": "true"}
# The webhooks of the integrations switched on below, and of Kueue's own resources.
FRAMEWORKS = ("batch/job", "pod", "deployment")
WEBHOOK_RESOURCES = {("batch", "jobs"), ("", "pods"), ("apps", "deployments")}


def _issue_serving_cert(cluster: LocalCluster, cert_dir: Path) -> None:
    """tls.crt/tls.key for 127.0.0.1, signed by the cluster's CA (controller-runtime's names)."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    issue_cert(cluster.workdir / "pki", cert_dir, "tls", "/CN=kueue-webhook", ext)


def _install_metrics_cert(cert_dir: Path) -> None:
    """Kueue without its internal certificate management reads its metrics server's certificate
    from a fixed path (cmd/kueue/main.go), which its image's Secret mount fills; here, a copy of the
    webhook's, unless one is there."""
    if all((METRICS_CERTS / name).exists() for name in ("tls.crt", "tls.key")):
        return
    try:
        METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(cert_dir / name, METRICS_CERTS / name)
    except PermissionError as exc:
        raise RuntimeError(
            f"Kueue's manager needs a certificate at {METRICS_CERTS} (a path fixed in its source): "
            f"run the e2e tier as root, or create that folder writable by this user ({exc})"
        ) from exc


def _served_webhooks(doc: dict[str, Any], port: int, ca_bundle: str) -> dict[str, Any]:
    """A webhook configuration of Kueue's with only the webhooks this setup serves, each called at
    https://127.0.0.1:<port><its path>; job, pod and deployment webhooks only in queued namespaces."""
    kept = []
    for hook in doc["webhooks"]:
        targets = {(group, res) for rule in hook["rules"] for group in rule["apiGroups"] for res in rule["resources"]}
        ours = targets <= WEBHOOK_RESOURCES
        if not ours and not all(group == "kueue.x-k8s.io" for group, _ in targets):
            continue
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
        if ours:
            hook["namespaceSelector"] = {"matchLabels": QUEUED_NAMESPACE_LABEL}
        kept.append(hook)
    return {**doc, "metadata": {"name": f"kueue-{doc['metadata']['name']}"}, "webhooks": kept}


def _configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(FRAMEWORKS)},
        # All-or-nothing start: an admitted workload whose pods are not all Ready within the
        # timeout is evicted and requeued, and nothing else is admitted meanwhile.
        "waitForPodsReady": {"timeout": "5m", "blockAdmission": True},
    }


def _ready(health_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextmanager
def running_kueue(cluster: LocalCluster, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Kueue installed on `cluster` and its manager running; on exit its webhooks are removed
    first (nothing may call a manager that is gone), then the manager stops."""
    docs = [d for d in yaml.safe_load_all((cluster.bin_dir / "kueue-manifests.yaml").read_text()) if d]
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    cluster.kubectl(
        "apply", "--server-side", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds})
    )
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{d['metadata']['name']}" for d in crds)
    )
    cluster.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)

    root = log_path.parent
    cert_dir = root / "kueue-certs"
    _issue_serving_cert(cluster, cert_dir)
    _install_metrics_cert(cert_dir)
    webhook_port, health_port = free_port(), free_port()
    config = root / "kueue-config.yaml"
    config.write_text(yaml.safe_dump(_configuration(webhook_port, health_port, cert_dir)))
    log("starting the Kueue manager")
    with open(log_path, "wb") as out:
        manager = subprocess.Popen(
            [
                str(cluster.bin_dir / "kueue"),
                f"--config={config}",
                # Its on-demand visibility API server (an aggregated API, certificates at another
                # fixed path) is not what these tests look at.
                "--feature-gates=VisibilityOnDemand=false",
                "--zap-log-level=2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cluster.env,
            start_new_session=True,
        )
    hooks: list[dict[str, Any]] = []
    try:
        wait_for(lambda: manager.poll() is not None or _ready(health_port), timeout=120, what="Kueue ready")
        if manager.poll() is not None:
            raise RuntimeError(f"the Kueue manager exited ({manager.returncode}):\n{log_path.read_text()[-4000:]}")
        ca_bundle = base64.b64encode((cluster.workdir / "pki" / "ca.crt").read_bytes()).decode()
        hooks = [
            _served_webhooks(d, webhook_port, ca_bundle) for d in docs if d["kind"].endswith("WebhookConfiguration")
        ]
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": hooks}))
        yield manager
    finally:
        for hook in hooks:
            cluster.kubectl("delete", hook["kind"].lower(), hook["metadata"]["name"], "--ignore-not-found", check=False)
        manager.terminate()
        try:
            manager.wait(timeout=30)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()
