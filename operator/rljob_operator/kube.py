"""A thin, counted Kubernetes client: get, list, server-side apply, delete, status patch.

Paths come from a static table of the kinds the operator renders, so applying costs exactly one
request (no discovery round-trips), and every request is counted for the metrics endpoint and the
benchmark's "API calls per reconcile".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from rljob.config import API_GROUP, API_VERSION, PLURAL
from rljob_operator import metrics
from rljob_operator.names import FIELD_MANAGER

# kind -> plural, for every kind the operator touches (all namespaced).
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "Job": "jobs",
    "NetworkPolicy": "networkpolicies",
    "Workload": "workloads",
    "PodGroup": "podgroups",
    "ScaledObject": "scaledobjects",
    "TriggerAuthentication": "triggerauthentications",
    "RLJob": PLURAL,
}
RLJOB_API = f"{API_GROUP}/{API_VERSION}"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, body: str) -> None:
        super().__init__(f"{status} {reason}: {body[:500]}")
        self.status, self.reason, self.body = status, reason, body

    @property
    def message(self) -> str:
        try:
            return json.loads(self.body).get("message", self.body)
        except ValueError:
            return self.body


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace)}/{PLURALS[kind]}"
    return f"{path}/{quote(name)}" if name else path


@dataclass
class Kube:
    """Synchronous client over the `kubernetes` package's configured ApiClient."""

    api: Any  # kubernetes.client.ApiClient

    @classmethod
    def from_environment(cls) -> Kube:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(kubernetes.client.ApiClient())

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        metrics.API_CALLS.labels(verb=method).inc()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # A dict body: the client serialises it once as JSON (valid YAML for apply patches too).
        m, url, hdrs, data, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        resp = self.api.call_api(m, url, hdrs, data, _request_timeout=30)
        raw = resp.read()
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status >= 300:
            raise ApiError(resp.status, resp.reason or "", raw.decode(errors="replace"))
        return json.loads(raw) if raw else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._request("GET", resource_path(api_version, kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self._request("GET", resource_path(api_version, kind, namespace), query=[("labelSelector", selector)])
        return (out or {}).get("items", [])

    def apply(self, manifest: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply: creates or updates, idempotent, owns only the fields it sets. With
        `dry_run`, the API server validates and admits it (webhooks and policies included) and
        stores nothing."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
        out = self._request("PATCH", path, query=query, body=manifest, content_type="application/apply-patch+yaml")
        assert out is not None
        return out

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (used for the once-only Redis Secret)."""
        path = resource_path(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["namespace"])
        try:
            return self._request("POST", path, body=manifest)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str, propagation: str = "Foreground") -> None:
        self._request(
            "DELETE",
            resource_path(api_version, kind, namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation},
        )

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = resource_path(RLJOB_API, "RLJob", namespace, name) + "/status"
        self._request("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")

    def api_available(self, api_version: str) -> bool:
        """Discovery: is this group/version served? (allowed to every authenticated user)."""
        try:
            return self._request("GET", f"/apis/{api_version}") is not None
        except ApiError as exc:
            if exc.status in (404, 503):
                return False
            raise
