"""hostlet: a kubelet stand-in that runs the pods bound to its Node as host processes.

Test code, not product (see README.md beside it). It registers a Node (Ready, tainted so only
pods that tolerate it land there) and keeps its Lease fresh; for each pod bound to it, it
materialises the volumes as host folders, builds the environment from the pod spec, starts the
container's command and writes the pod's status back as a kubelet does. It also provisions
claims of its StorageClass as hostPath volumes, so StatefulSet claim templates bind.

Run: python e2e/hostlet/hostlet.py --kubeconfig K --root DIR [--node NAME] [--path PATH]
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from podspec import (
    LOOPBACK,
    PodSpecError,
    container_argv,
    container_env,
    exit_code,
    path_rewriter,
    projected_files,
)

NODE_LABEL = "rljob.dev/host-process"
STORAGE_CLASS = "host-folder"
PROVISIONER = "rljob.dev/hostlet"
LEASE_SECONDS = 40
RESTART_BACKOFF_MAX = 20.0  # a kubelet's doubles from 10 s to 5 min; shortened for tests


def log(msg: str) -> None:
    print(f"[hostlet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plain(obj: Any) -> Any:
    """An API object as the JSON dict the server sent (camelCase keys), for the pure helpers."""
    return client.ApiClient().sanitize_for_serialization(obj)


@dataclass
class Container:
    """One pod's container process, across its restarts."""

    pod_dir: Path
    argv: list[str]
    env: dict[str, str]
    restart_policy: str
    readiness: dict[str, Any] | None
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restarts: int = 0
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    restart_at: float = 0.0
    probe_at: float = 0.0
    kill_at: float | None = None
    finished: bool = False

    def start(self) -> None:
        with open(self.pod_dir / "container.log", "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.pod_dir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        (self.pod_dir / "container.pid").write_text(str(self.proc.pid))
        self.started_at, self.ready, self.probe_at = now(), self.readiness is None, 0.0

    def send(self, sig: signal.Signals) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def probe(self) -> None:
        """Exec readiness probes, run as host processes with the container's environment."""
        if not self.readiness or time.monotonic() < self.probe_at:
            return
        self.probe_at = time.monotonic() + self.readiness.get("periodSeconds", 10)
        command = self.readiness.get("exec", {}).get("command")
        if not command:
            self.ready = True  # httpGet and tcpSocket probes: ready once running
            return
        try:
            result = subprocess.run(
                command, env=self.env, capture_output=True, timeout=self.readiness.get("timeoutSeconds", 1)
            )
            self.ready = result.returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            self.ready = False


@dataclass
class Hostlet:
    root: Path
    node: str = "hostlet"
    path: str = os.environ.get("PATH", "/usr/bin:/bin")
    image_env: dict[str, str] = field(default_factory=dict)  # what an image's ENV would set
    cpu: str = "16"
    memory: str = "64Gi"
    pods: dict[str, Container] = field(default_factory=dict)  # pod uid -> container
    failed_to_start: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api()
        self.coordination = client.CoordinationV1Api()
        self.storage = client.StorageV1Api()
        self._lease_at = 0.0
        self._node_at = 0.0

    # -- the Node, its Lease and the StorageClass ----------------------------------------------
    def register(self) -> None:
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "100Gi"}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux", NODE_LABEL: "true"},
            },
            "spec": {"taints": [{"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}]},
        }
        try:
            self.core.create_node(node)
        except ApiException as err:
            if err.status != 409:
                raise
        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": self.node}],
            "nodeInfo": {
                "kubeletVersion": "hostlet",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "host-process://0",
                "kernelVersion": os.uname().release,
                "osImage": "host",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
        self.core.patch_node_status(self.node, {"status": status})
        self.heartbeat(force=True)
        sc = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS, "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": PROVISIONER,
            "volumeBindingMode": "Immediate",
            "reclaimPolicy": "Delete",
        }
        try:
            self.storage.create_storage_class(sc)
        except ApiException as err:
            if err.status != 409:
                raise
        log(f"node {self.node} registered; pods run under {self.root}")

    def heartbeat(self, force: bool = False) -> None:
        t = time.monotonic()
        if force or t >= self._lease_at:
            self._lease_at = t + 10
            spec = {
                "holderIdentity": self.node,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": dt.datetime.now(dt.UTC),
            }
            try:
                self.coordination.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
            except ApiException as err:
                if err.status != 404:
                    raise
                self.coordination.create_namespaced_lease(
                    "kube-node-lease", {"metadata": {"name": self.node}, "spec": spec}
                )
        if force or t >= self._node_at:
            self._node_at = t + 30
            ready = {
                "type": "Ready",
                "status": "True",
                "reason": "HostletReady",
                "message": "hostlet is posting ready status",
                "lastHeartbeatTime": now(),
                "lastTransitionTime": now(),
            }
            self.core.patch_node_status(self.node, {"status": {"conditions": [ready]}})

    def unregister(self) -> None:
        for delete in (
            lambda: self.core.delete_node(self.node),
            lambda: self.storage.delete_storage_class(STORAGE_CLASS),
        ):
            with contextlib.suppress(ApiException):
                delete()

    # -- claims of the host-folder class --------------------------------------------------------
    def provision(self) -> None:
        for pvc in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            if pvc.status.phase != "Pending" or pvc.spec.storage_class_name != STORAGE_CLASS or pvc.spec.volume_name:
                continue
            folder = self.root / "claims" / pvc.metadata.namespace / pvc.metadata.name
            folder.mkdir(parents=True, exist_ok=True)
            pv = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {
                    "name": f"pvc-{pvc.metadata.uid}",
                    "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
                },
                "spec": {
                    "capacity": {"storage": pvc.spec.resources.requests["storage"]},
                    "accessModes": pvc.spec.access_modes,
                    "storageClassName": STORAGE_CLASS,
                    "persistentVolumeReclaimPolicy": "Delete",
                    "hostPath": {"path": str(folder)},
                    "claimRef": {
                        "namespace": pvc.metadata.namespace,
                        "name": pvc.metadata.name,
                        "uid": pvc.metadata.uid,
                    },
                },
            }
            try:
                self.core.create_persistent_volume(pv)
                log(f"provisioned {folder} for claim {pvc.metadata.namespace}/{pvc.metadata.name}")
            except ApiException as err:
                if err.status != 409:
                    raise
        # Released volumes of this class are deleted (reclaimPolicy Delete), folder and all.
        for pv in self.core.list_persistent_volume().items:
            if pv.spec.storage_class_name == STORAGE_CLASS and pv.status.phase == "Released":
                shutil.rmtree(pv.spec.host_path.path, ignore_errors=True)
                with contextlib.suppress(ApiException):
                    self.core.delete_persistent_volume(pv.metadata.name)

    # -- pods ------------------------------------------------------------------------------------
    def _decoded(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        try:
            obj = (self.core.read_namespaced_secret if kind == "Secret" else self.core.read_namespaced_config_map)(
                name, ns
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in (obj.data or {}).items()}
        return dict(obj.data or {})

    def _volume_folder(self, pod: dict[str, Any], volume: dict[str, Any], pod_dir: Path) -> Path:
        ns = pod["metadata"]["namespace"]
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = self.core.read_namespaced_persistent_volume_claim(claim, ns)
            if pvc.spec.volume_name:
                pv = self.core.read_persistent_volume(pvc.spec.volume_name)
                if pv.spec.host_path:
                    return Path(pv.spec.host_path.path)
            return self.root / "claims" / ns / claim  # one folder per claim, shared by its pods
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        folder = pod_dir / "volumes" / name
        folder.mkdir(parents=True, exist_ok=True)
        for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
            if key in volume:
                ref = volume[key].get("name") or volume[key].get("secretName")
                data = self._decoded(kind, ns, ref)
                if data is None and not volume[key].get("optional"):
                    raise PodSpecError(f"volume {name}: {kind} {ref} not found")
                for rel, content in projected_files(volume, data or {}).items():
                    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                    (folder / rel).write_text(content)
        if not {"emptyDir", "configMap", "secret"} & volume.keys():
            raise PodSpecError(f"volume {name}: only emptyDir, configMap, secret, persistentVolumeClaim, hostPath")
        return folder

    def _prepare(self, pod: dict[str, Any]) -> Container:
        meta, spec = pod["metadata"], pod["spec"]
        if len(spec["containers"]) != 1 or spec.get("initContainers"):
            raise PodSpecError("the hostlet runs pods of exactly one container and no init containers")
        (container,) = spec["containers"]
        ns = meta["namespace"]
        pod_dir = self.root / "pods" / ns / f"{meta['name']}-{meta['uid'][:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        folders = {v["name"]: self._volume_folder(pod, v, pod_dir) for v in spec.get("volumes", [])}
        mounts: dict[str, str] = {}
        for mount in container.get("volumeMounts", []):
            host = folders[mount["name"]] / mount.get("subPath", "")
            host.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = str(host)
        env = container_env(
            pod, container, lambda n: self._decoded("Secret", ns, n), lambda n: self._decoded("ConfigMap", ns, n)
        )
        rewrite = path_rewriter(mounts)
        env = {k: rewrite(v) for k, v in env.items()}
        hostname = spec.get("hostname") or meta["name"]
        process_env = {"PATH": self.path, "HOSTNAME": hostname, "HOME": str(pod_dir), **self.image_env, **env}
        argv = [rewrite(a) for a in container_argv(container, env)]
        return Container(
            pod_dir, argv, process_env, spec.get("restartPolicy", "Always"), container.get("readinessProbe")
        )

    def _status(self, pod: dict[str, Any], c: Container, phase: str | None = None) -> None:
        (container,) = pod["spec"]["containers"]
        if c.proc and c.proc.poll() is None and not c.finished:
            state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
        elif c.finished or c.last_terminated is None:
            state = {"terminated": c.last_terminated or {"exitCode": 0, "reason": "Completed"}}
        else:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"restarting after {c.last_terminated}"}}
        ready = bool(c.ready and "running" in state)
        status = {
            "phase": phase or "Running",
            "hostIP": LOOPBACK,
            "podIP": LOOPBACK,
            "podIPs": [{"ip": LOOPBACK}],
            "startTime": pod.get("status", {}).get("startTime") or now(),
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now()},
                {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now()},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": now()},
            ],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": ready,
                    "started": "running" in state,
                    "restartCount": c.restarts,
                    "state": state,
                    **(
                        {"lastState": {"terminated": c.last_terminated}} if c.last_terminated and not c.finished else {}
                    ),
                }
            ],
        }
        try:
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
            )
        except ApiException as err:
            if err.status != 404:
                raise

    def _fail_to_start(self, pod: dict[str, Any], err: Exception) -> None:
        uid = pod["metadata"]["uid"]
        self.failed_to_start.add(uid)
        log(f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} cannot start: {err}")
        container = pod["spec"]["containers"][0]
        status = {
            "phase": "Failed",
            "reason": "CreateContainerConfigError",
            "message": str(err),
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {
                        "terminated": {"exitCode": 1, "reason": "CreateContainerConfigError", "message": str(err)}
                    },
                }
            ],
        }
        self.core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status})

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions={"uid": pod["metadata"]["uid"]})
        try:
            self.core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"], body=body)
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    def sync(self) -> None:
        listed = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
        seen = set()
        for pod_obj in listed:
            pod = plain(pod_obj)
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            c = self.pods.get(uid)
            terminal = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod, c)
                continue
            if uid in self.failed_to_start or (c is None and terminal):
                continue
            if c is None:
                try:
                    c = self._prepare(pod)
                except (PodSpecError, ApiException, OSError) as err:
                    self._fail_to_start(pod, err)
                    continue
                self.pods[uid] = c
                c.start()
                log(
                    f"started {pod['metadata']['namespace']}/{pod['metadata']['name']} (pid {c.proc.pid}): {c.argv[:3]}"
                )
                self._status(pod, c)
                continue
            self._step(pod, c)
        for uid in set(self.pods) - seen:  # deleted without a grace period: the process goes too
            self.pods.pop(uid).send(signal.SIGKILL)

    def _step(self, pod: dict[str, Any], c: Container) -> None:
        if c.finished:
            return
        assert c.proc is not None
        code = c.proc.poll()
        if code is None:
            was = c.ready
            c.probe()
            if c.ready != was or pod.get("status", {}).get("phase") != "Running":
                self._status(pod, c)
            return
        if c.restart_at and time.monotonic() >= c.restart_at:
            c.restart_at, c.restarts = 0.0, c.restarts + 1
            c.start()
            log(f"restarted {pod['metadata']['name']} (restart {c.restarts})")
            self._status(pod, c)
            return
        if c.restart_at:
            return
        exit_status = exit_code(code)
        c.last_terminated = {
            "exitCode": exit_status,
            "reason": "Completed" if exit_status == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now(),
        }
        c.ready = False
        restart = c.restart_policy == "Always" or (c.restart_policy == "OnFailure" and exit_status != 0)
        log(f"{pod['metadata']['name']} exited with {exit_status}{'; restarting' if restart else ''}")
        if restart:
            c.restart_at = time.monotonic() + min(RESTART_BACKOFF_MAX, 2.0**c.restarts)
            self._status(pod, c)
        else:
            c.finished = True
            self._status(pod, c, "Succeeded" if exit_status == 0 else "Failed")

    def _terminate(self, pod: dict[str, Any], c: Container | None) -> None:
        """SIGTERM, SIGKILL after the grace period, then the final delete a kubelet makes."""
        if c is not None and c.proc is not None and c.proc.poll() is None:
            if c.kill_at is None:
                grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
                c.kill_at = time.monotonic() + grace
                c.send(signal.SIGTERM)
                log(f"stopping {pod['metadata']['name']} (grace {grace}s)")
            elif time.monotonic() >= c.kill_at:
                c.send(signal.SIGKILL)
            return
        self.pods.pop(pod["metadata"]["uid"], None)
        self._delete_pod(pod)

    def stop_all(self) -> None:
        for c in self.pods.values():
            c.send(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for c in self.pods.values():
            while c.proc and c.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            c.send(signal.SIGKILL)

    def run(self, stop: threading.Event, interval: float = 0.5) -> None:
        self.register()
        try:
            provision_at = 0.0
            while not stop.is_set():
                try:
                    self.heartbeat()
                    if time.monotonic() >= provision_at:
                        provision_at = time.monotonic() + 2
                        self.provision()
                    self.sync()
                except (ApiException, OSError) as err:  # the API server restarting, a race on a pod
                    log(f"sync failed, retrying: {err}")
                stop.wait(interval)
        finally:
            self.stop_all()
            self.unregister()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--node", default="hostlet")
    parser.add_argument("--path", default=os.environ.get("PATH", "/usr/bin:/bin"), help="PATH of every container")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment every container starts with, as an image's ENV (the pod's env wins)",
    )
    args = parser.parse_args(argv)
    config.load_kube_config(args.kubeconfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    image_env = dict(item.split("=", 1) for item in args.env)
    Hostlet(args.root, args.node, args.path, image_env).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
