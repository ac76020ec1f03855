"""The CRD is generated from the model, structural, and committed identically in crds/ and the chart."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from rljob.config import RLJob
from rljob_operator.crd import CRD_PATHS, NAME_PATTERN, build_crd, main, render_crd_yaml
from rljob_operator.render import RenderPlan, render_children


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_committed_crds_match_the_model() -> None:
    text = render_crd_yaml()
    for path in CRD_PATHS:
        assert path.exists(), f"{path} missing: run python -m rljob_operator.crd --write"
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run python -m rljob_operator.crd --write"
    assert main(["--check"]) == 0


def test_schema_is_structural() -> None:
    forbidden = {"$ref", "anyOf", "allOf", "oneOf", "title", "additionalProperties", "const"}
    for path, node in _walk(_schema()):
        assert not forbidden & set(node), f"{path}: {forbidden & set(node)}"
        assert "type" in node, f"{path} has no type"
        if path.startswith(".spec") and path.count(".") > 1:
            assert node.get("description"), f"{path} has no description (kubectl explain)"


def test_defaults_ranges_enums_and_cel() -> None:
    spec = _schema()["properties"]["spec"]
    grpo = spec["properties"]["grpo"]
    assert grpo["default"]["groupSize"] == 8 and grpo["default"]["learningRate"] == 1e-6
    lr = grpo["properties"]["learningRate"]
    assert lr["minimum"] == 0 and lr["exclusiveMinimum"] is True and lr["default"] == 1e-6
    assert grpo["properties"]["groupSize"]["minimum"] == 2
    assert spec["properties"]["rollout"]["properties"]["engine"]["enum"] == ["vllm", "hf"]
    gang = spec["properties"]["trainer"]["properties"]["gangProvider"]
    assert gang["enum"] == ["workload", "volcano", "coscheduling", "none"]
    rules = [r["rule"] for r in spec["properties"]["rollout"]["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in rules
    assert spec["properties"]["model"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert (
        "ttlSecondsAfterFinished" in spec["properties"]
        and "default" not in spec["properties"]["ttlSecondsAfterFinished"]
    )


def test_status_and_printer_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for name in ("Phase", "Step", "Reward", "EM", "Version", "Rollouts", "Age"):
        assert name in columns
    status = _schema()["properties"]["status"]["properties"]
    phases = ["Pending", "Queued", "Initializing", "Running", "Succeeded", "Failed", "Suspended"]
    assert status["phase"]["enum"] == phases
    cond = status["conditions"]["items"]["properties"]
    assert {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"} <= set(cond)
    for node_path, node in _walk(_schema()["properties"]["status"]):
        assert "default" not in node, node_path


def test_yaml_is_deterministic() -> None:
    assert render_crd_yaml() == render_crd_yaml()
    assert yaml.safe_load(render_crd_yaml())["metadata"]["name"] == "rljobs.rljob.dev"


DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # what the API server wants of a Service name


@pytest.mark.parametrize("name", ["qwen2.5-grpo", "7b-run", "-x", "x-", "Tiny"])
def test_names_that_would_make_invalid_children_are_refused(name: str) -> None:
    # Each is a valid DNS-1123 subdomain (a legal custom resource name, but for the upper case),
    # yet a Service named after it is refused: the CRD must refuse the RLJob at `kubectl apply`.
    rules = [r["rule"] for r in _schema()["x-kubernetes-validations"]]
    assert f"self.metadata.name.matches('{NAME_PATTERN}')" in rules
    assert not re.search(NAME_PATTERN, name)


@pytest.mark.parametrize("name", ["tiny", "qwen25-grpo", "run-7b", "a"])
def test_names_the_crd_accepts_make_valid_children(name: str) -> None:
    assert re.search(NAME_PATTERN, name)
    job = RLJob.model_validate({"metadata": {"name": name, "namespace": "ns"}, "spec": {}})
    children = render_children(job, RenderPlan(uid="u", rollout_replicas=1))
    services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
    assert services and all(DNS1035_LABEL.match(s) for s in services), services
    trainer = next(c for c in children if c["kind"] == "Job")
    assert DNS1035_LABEL.match(trainer["spec"]["template"]["spec"]["subdomain"])
