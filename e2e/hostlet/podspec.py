"""Pure pieces of the hostlet: a pod spec in, what its host process needs out.

No API calls here: Secrets and ConfigMaps come in as plain dicts (`data` already decoded), so
each rule a kubelet applies (env resolution, `$(VAR)` expansion, field paths, mount paths) can be
read and tested on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Lookup = Callable[[str], Mapping[str, str] | None]  # name -> decoded data, or None if absent

# A Service name as the operator renders it: <svc>.<ns>.svc, or a pod under a headless Service
# (<pod>.<svc>.<ns>.svc), with or without the cluster domain.
SERVICE_HOST = re.compile(r"\b[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.svc(\.cluster\.local)?\b")
LOOPBACK = "127.0.0.1"
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class PodSpecError(ValueError):
    """What a kubelet would report as CreateContainerConfigError: the pod cannot start as written."""


def expand_references(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` escapes, others stay."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(sub, value)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's `fieldRef.fieldPath` for the fields a kubelet supports in env."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": LOOPBACK,
        "status.podIP": LOOPBACK,
    }
    if path in simple:
        return str(simple[path] or "")
    keyed = _FIELD_KEY.match(path)
    if keyed:
        return str(meta.get(keyed.group(1), {}).get(keyed.group(2), ""))
    raise PodSpecError(f"fieldRef {path!r} is not supported")


def _from_source(kind: str, ref: Mapping[str, Any], lookup: Lookup) -> str | None:
    data = lookup(ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        what = f"{kind} {ref['name']}" if data is None else f"key {ref['key']!r} in {kind} {ref['name']}"
        raise PodSpecError(f"{what} not found")
    return data[ref["key"]]


def container_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], secrets: Lookup, config_maps: Lookup
) -> dict[str, str]:
    """The container's environment as a kubelet builds it: envFrom first, then env in order,
    each value able to refer to the ones before it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        kind, ref, lookup = (
            ("Secret", source["secretRef"], secrets)
            if "secretRef" in source
            else ("ConfigMap", source["configMapRef"], config_maps)
        )
        data = lookup(ref["name"])
        if data is None and not ref.get("optional"):
            raise PodSpecError(f"{kind} {ref['name']} not found")
        env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand_references(var.get("value", ""), env)
            continue
        if "fieldRef" in source:
            value: str | None = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            value = _from_source("Secret", source["secretKeyRef"], secrets)
        elif "configMapKeyRef" in source:
            value = _from_source("ConfigMap", source["configMapKeyRef"], config_maps)
        else:
            raise PodSpecError(f"env {var['name']}: only fieldRef, secretKeyRef and configMapKeyRef are supported")
        if value is not None:
            env[var["name"]] = value
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; there is no image, so no entrypoint to fall back on."""
    command = container.get("command")
    if not command:
        raise PodSpecError(f"container {container['name']} has no command (the hostlet runs no images)")
    return [expand_references(part, env) for part in [*command, *container.get("args", [])]]


def path_rewriter(mounts: Mapping[str, str]) -> Callable[[str], str]:
    """Rewrite mount paths (longest first, whole path components only) to their host folders,
    and Service names to loopback: there is no mount namespace and no cluster DNS."""
    ordered = sorted(mounts, key=len, reverse=True)
    pattern = (
        re.compile(r"(?<![\w./-])(" + "|".join(re.escape(m.rstrip("/")) for m in ordered) + r")(?=/|$|[^\w./-])")
        if ordered
        else None
    )
    by_path = {m.rstrip("/"): host for m, host in mounts.items()}

    def rewrite(text: str) -> str:
        text = SERVICE_HOST.sub(LOOPBACK, text)
        return pattern.sub(lambda m: by_path[m.group(1)], text) if pattern else text

    return rewrite


def projected_files(volume: Mapping[str, Any], data: Mapping[str, str]) -> dict[str, str]:
    """Relative file name -> content for a ConfigMap or Secret volume (its `items`, if given)."""
    source = volume.get("configMap") or volume.get("secret") or {}
    items = source.get("items")
    if not items:
        return dict(data)
    missing = [i["key"] for i in items if i["key"] not in data]
    if missing and not source.get("optional"):
        raise PodSpecError(f"volume {volume['name']}: keys {missing} not found")
    return {i["path"]: data[i["key"]] for i in items if i["key"] in data}


def exit_code(returncode: int) -> int:
    """A container runtime's exit code: 128 + signal for a process a signal ended."""
    return 128 - returncode if returncode < 0 else returncode
