"""A real Kubernetes control plane on loopback, without Docker or a kubelet.

etcd, kube-apiserver (RBAC, service-account token signing), kube-controller-manager and
kube-scheduler run as plain processes from binaries built by `build.sh`; kwok plays the kubelet for
fake GPU nodes, so scheduled pods become Running. Every port is a free loopback port, every file
lives in one temp dir, and `stop()` ends every process it started and removes that dir.

Run by hand: `python e2e/cluster/localcluster.py up` prints the KUBECONFIG and waits for Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from rljob.ports import free_port

HERE = Path(__file__).resolve().parent
# Kubernetes' own gang scheduling (the Workload API and the scheduler's gang plugin) per minor
# version: the feature gates every component needs, and the API version the server must serve.
# Beta in 1.37 but, as every new beta API, off by default; alpha in 1.36.
WORKLOAD_SCHEDULING = {
    36: ("GenericWorkload=true,GangScheduling=true", "scheduling.k8s.io/v1alpha2=true"),
    37: ("GenericWorkload=true", "scheduling.k8s.io/v1beta1=true"),
}


@dataclass(frozen=True)
class FakeNodeSpec:
    count: int = 4
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def supported_kube_versions() -> list[str]:
    """The Kubernetes versions build.sh pins, newest (its default) first."""
    found = re.search(r"^SUPPORTED_KUBE_VERSIONS=\(([^)]*)\)", (HERE / "build.sh").read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError("e2e/cluster/build.sh names no SUPPORTED_KUBE_VERSIONS")
    return found.group(1).split()


def build_binaries(kube_version: str | None = None) -> Path:
    """Run build.sh (a no-op when the cache is warm) and return the binaries' directory: for
    build.sh's default Kubernetes version, or `kube_version` (one build.sh pins)."""
    env = {**os.environ, "RLJOB_KUBE_VERSION": kube_version} if kube_version else None
    result = subprocess.run(["bash", str(HERE / "build.sh")], stdout=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"e2e/cluster/build.sh failed with exit code {result.returncode}")
    return Path(result.stdout.strip().splitlines()[-1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def issue_cert(pki: Path, out: Path, name: str, subject: str, ext: str) -> None:
    """`out/<name>.key` and `out/<name>.crt` for `subject`, signed by the CA in `pki`."""
    (out / f"{name}.ext").write_text(ext)
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        subject,
        "-keyout",
        str(out / f"{name}.key"),
        "-out",
        str(out / f"{name}.csr"),
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(out / f"{name}.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(out / f"{name}.ext"),
        "-out",
        str(out / f"{name}.crt"),
    )


def make_pki(pki: Path) -> None:
    """A CA, the apiserver's serving cert, an admin client cert and the service-account key pair."""
    pki.mkdir(parents=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=rljob-e2e-ca",
        "-keyout",
        str(pki / "ca.key"),
        "-out",
        str(pki / "ca.crt"),
    )
    issue_cert(
        pki,
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default\n"
        "extendedKeyUsage=serverAuth\n",
    )
    issue_cert(pki, pki, "admin", "/O=system:masters/CN=rljob-e2e-admin", "extendedKeyUsage=clientAuth\n")
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    user: str = "admin",
) -> Path:
    """A kubeconfig with one cluster, one user (client cert or bearer token) and one context."""
    user_entry: dict[str, str] = {}
    if cert and key:
        user_entry = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user_entry = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
        "current-context": "e2e",
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


@dataclass
class LocalCluster:
    bin_dir: Path
    nodes: FakeNodeSpec = field(default_factory=FakeNodeSpec)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rljob-e2e-")))
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def kube_version(self) -> str:
        """The Kubernetes version build.sh built these binaries for (the cache directory's key)."""
        found = re.match(r"kube-(v\d+\.\d+\.\d+)_", self.bin_dir.name)
        if found is None:
            raise ValueError(f"{self.bin_dir} is not a directory e2e/cluster/build.sh made")
        return found.group(1)

    @property
    def kube_minor(self) -> int:
        return int(self.kube_version.split(".")[1])

    @property
    def workload_api(self) -> str:
        """The Workload API group/version this control plane serves."""
        return WORKLOAD_SCHEDULING[self.kube_minor][1].removesuffix("=true")

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.workdir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.workdir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.workdir / "helm" / "data")
        return env

    # -- commands -------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.bin_dir / "kubectl"), *args], input, check, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.bin_dir / "helm"), *args], None, check, timeout)

    def _run(self, cmd: list[str], input: str | None, check: bool, timeout: float) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])}... failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def kubeconfig_for_serviceaccount(self, namespace: str, name: str, duration: str = "2h") -> Path:
        """A kubeconfig that authenticates as a ServiceAccount through a TokenRequest."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        path = self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(
            path,
            self.server,
            self.workdir / "pki" / "ca.crt",
            token=token,
            user=f"system:serviceaccount:{namespace}:{name}",
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        logfile = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
        self.processes[name] = subprocess.Popen(
            [str(self.bin_dir / args[0]), *args[1:]],
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.workdir,
        )
        logfile.close()

    def _wait(self, what: str, check, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{tail}")
            if check():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what} (logs in {self.workdir})")

    def start(self) -> LocalCluster:
        started = time.monotonic()
        gates, runtime_config = WORKLOAD_SCHEDULING[self.kube_minor]
        pki = self.workdir / "pki"
        make_pki(pki)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        write_kubeconfig(self.kubeconfig, self.server, pki / "ca.crt", cert=pki / "admin.crt", key=pki / "admin.key")

        log("starting etcd")
        self._spawn(
            "etcd",
            [
                "etcd",
                "--name=e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=e2e=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: _port_open(etcd_port))

        log("starting kube-apiserver")
        self._spawn(
            "kube-apiserver",
            [
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                # 1.37 refuses a loopback address in the `kubernetes` Service's endpoints; nothing
                # here reaches the API server through that Service (the operator runs beside it).
                "--endpoint-reconciler-type=none",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                # As OpenShift runs it: setting blockOwnerDeletion on a child needs update on its owner's
                # finalizers, which the chart's RBAC must then grant. A namespace's annotations place
                # its pods (e2e/hostlet's namespaces on the hostlet's node).
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement,PodNodeSelector,PodTolerationRestriction",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                f"--feature-gates={gates}",
                f"--runtime-config={runtime_config}",
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
                "--profiling=false",
            ],
        )
        self._wait("kube-apiserver /readyz", lambda: self.kubectl("get", "--raw=/readyz", check=False).returncode == 0)

        kubeconfig = str(self.kubeconfig)
        log("starting kube-controller-manager, kube-scheduler and kwok")
        self._spawn(
            "kube-controller-manager",
            [
                "kube-controller-manager",
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                "--use-service-account-credentials=true",
                f"--feature-gates={gates}",
                "--kube-api-qps=1000",
                "--kube-api-burst=1000",
                "--concurrent-gc-syncs=20",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                "kube-scheduler",
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--feature-gates={gates}",
                "--kube-api-qps=1000",
                "--kube-api-burst=1000",
            ],
        )
        self._spawn(
            "kwok",
            [
                "kwok",
                f"--kubeconfig={kubeconfig}",
                f"--config={self.bin_dir / 'kwok-stages.yaml'}",
                # Only the fake GPU nodes: e2e/hostlet's node runs its pods for real.
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--server-address=127.0.0.1:{free_port()}",
                "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40",
            ],
        )
        self.kubectl("apply", "-f", "-", input=self.render_nodes())
        self._wait(
            "default ServiceAccount",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
        )
        self._wait("fake nodes Ready", self._nodes_ready)
        log(f"cluster up in {time.monotonic() - started:.1f}s; KUBECONFIG={self.kubeconfig}")
        return self

    def render_nodes(self) -> str:
        items = []
        for i in range(self.nodes.count):
            capacity = {
                "cpu": self.nodes.cpu,
                "memory": self.nodes.memory,
                "pods": str(self.nodes.pods),
                "nvidia.com/gpu": str(self.nodes.gpus),
            }
            items.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": f"kwok-gpu-{i}",
                        "annotations": {"kwok.x-k8s.io/node": "fake"},
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": f"kwok-gpu-{i}",
                            "nvidia.com/gpu.present": "true",
                        },
                    },
                    "status": {"capacity": capacity, "allocatable": capacity},
                }
            )
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})

    def _nodes_ready(self) -> bool:
        out = self.kubectl(
            "get",
            "nodes",
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status} {end}",
            check=False,
        ).stdout.split()
        return len(out) == self.nodes.count and all(s == "True" for s in out)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_for(predicate, timeout: float = 60, interval: float = 0.5, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned); fail the test on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    if argv[1:] != ["up"]:
        print(textwrap.dedent(__doc__ or ""), file=sys.stderr)
        return 2
    cluster = LocalCluster(build_binaries())
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        cluster.start()
        print(f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
