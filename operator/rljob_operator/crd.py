"""Generate the RLJob CustomResourceDefinition from the pydantic API model.

One source of truth: `rljob.config.RLJob` (spec) and `rljob_operator.api.RLJobStatus` (status).
pydantic's JSON Schema is turned into a Kubernetes *structural* schema: `$ref`s inlined, optional
fields unwrapped from `anyOf [T, null]`, draft-2020 exclusive bounds rewritten in OpenAPI v3 form,
object fields defaulted to `{}` so the API server fills nested defaults, and the CEL rules the
model carries as `x-kubernetes-validations` kept in place.

`python -m rljob_operator.crd --write` rewrites `crds/` and `charts/rljob/crds/`;
`--check` exits non-zero when either differs from the model.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from rljob.config import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAMES, SINGULAR, RLJobSpec, cel
from rljob_operator.api import RLJobStatus

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = f"{PLURAL}.{API_GROUP}.yaml"
CRD_PATHS = (REPO_ROOT / "crds" / CRD_FILE, REPO_ROOT / "charts" / "rljob" / "crds" / CRD_FILE)
MAX_NAME_LENGTH = 40  # children append suffixes such as "-trainer-1023" and must stay DNS labels
# Children's names extend the RLJob's: Services must be DNS-1035 labels (a letter first, no dots),
# and the trainer pods' subdomain a DNS-1123 label. An RLJob name is only a DNS-1123 subdomain.
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Keys a structural schema keeps, in the order they are written (readable diffs).
# `additionalProperties: false` is not allowed beside `properties`; unknown fields are refused by
# kubectl's strict field validation and pruned by the API server instead.
_KEEP = (
    "description",
    "type",
    "format",
    "default",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "nullable",
    "required",
    "properties",
    "items",
    "x-kubernetes-validations",
)

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Job phase."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Optimiser steps done."},
    {"name": "Reward", "type": "number", "jsonPath": ".status.meanReward", "description": "Mean reward, last step."},
    {"name": "EM", "type": "number", "jsonPath": ".status.evalExactMatch", "description": "Held-out exact match."},
    {"name": "Version", "type": "integer", "jsonPath": ".status.policyVersion", "description": "Weight version."},
    {"name": "Rollouts", "type": "string", "jsonPath": ".status.rollouts", "description": "Ready/desired workers."},
    {
        "name": "Restarts",
        "type": "integer",
        "jsonPath": ".status.restarts",
        "priority": 1,
        "description": "Gang restarts.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline `$ref` and single-element `allOf`, keeping sibling keys (description, CEL rules)."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **node}
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = _resolve(node.pop("allOf")[0], defs)
        node = {**inner, **node}
    return node


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {branches}")
        node = {**_resolve(branches[0], defs), **node}
        if node.get("default", 0) is None:
            node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key in _KEEP:
        if key not in node:
            continue
        value = node[key]
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = copy.deepcopy(value)
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(exclusive), int | float) and not isinstance(out[exclusive], bool):
            out[bound] = out.pop(exclusive)
            out[exclusive] = True
    out = {k: out[k] for k in _KEEP if k in out}
    if out.get("type") == "object" and "properties" in out:
        for name, sub in out["properties"].items():
            # Nested objects default to their fields' defaults, so an omitted section is filled
            # in. Written out in full (not `{}`): the API server checks CEL rules against defaults.
            if sub.get("type") == "object" and "properties" in sub and name not in out.get("required", []):
                sub.setdefault("default", {k: v["default"] for k, v in sub["properties"].items() if "default" in v})
                sub_keys = list(sub)
                sub_keys.insert(2, sub_keys.pop(sub_keys.index("default")))
                out["properties"][name] = {k: sub[k] for k in sub_keys}
    if out.get("type") == "array" and out.get("default") == []:
        out.pop("default")
    return out


def _strip_defaults(node: dict[str, Any]) -> dict[str, Any]:
    """Status is written by the operator: no server-side defaults there."""
    node = {k: v for k, v in node.items() if k != "default"}
    if "properties" in node:
        node["properties"] = {k: _strip_defaults(v) for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = _strip_defaults(node["items"])
    return node


def spec_schema() -> dict[str, Any]:
    raw = RLJobSpec.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def status_schema() -> dict[str, Any]:
    raw = RLJobStatus.model_json_schema(by_alias=True, mode="serialization")
    schema = _strip_defaults(_structural(raw, raw.get("$defs", {})))
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def build_crd() -> dict[str, Any]:
    """The whole CRD as a dict (deterministic: same model, same bytes)."""
    root = {
        "type": "object",
        "description": "RLJob trains a tool-using LLM agent with GRPO: rollout workers, a trainer gang and "
        "a weight store, reconciled by the rljob operator.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object."},
            "kind": {"type": "string", "description": "Kind of this object (RLJob)."},
            "metadata": {"type": "object"},
            "spec": {**spec_schema(), "default": {}},
            "status": status_schema(),
        },
        "x-kubernetes-validations": [
            cel(
                f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children's names extend it)",
            ),
            cel(
                f"self.metadata.name.matches('{NAME_PATTERN}')",
                "metadata.name must start with a lowercase letter and contain only lowercase letters, digits "
                "and '-' (no dots; it names the job's Services)",
            ),
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "annotations": {"rljob.dev/generated-by": "python -m rljob_operator.crd --write"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "rljob"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated from rljob.config by `python -m rljob_operator.crd --write`. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite crds/ and charts/rljob/crds/")
    mode.add_argument("--check", action="store_true", help="fail when a committed CRD is stale")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    if args.write:
        for path in CRD_PATHS:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = [p for p in CRD_PATHS if not p.exists() or p.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"stale: {path} (run python -m rljob_operator.crd --write)", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
