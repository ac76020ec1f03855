"""The hostlet's pure rules, without a cluster: what env, argv and paths a pod's process gets."""

from __future__ import annotations

import pytest
from podspec import PodSpecError, container_argv, container_env, exit_code, path_rewriter, projected_files

POD = {
    "metadata": {
        "name": "job-trainer-0-x",
        "namespace": "ns",
        "uid": "u1",
        "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
    },
    "spec": {"nodeName": "hostlet"},
}


def test_env_resolves_sources_in_order_with_references() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(MISSING)-$$(A)"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}},
            {
                "name": "RANK",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}}},
        ],
    }
    env = container_env(POD, container, {"s": {"password": "pw"}}.get, {"cm": {"x": "1"}}.get)
    assert env == {"CM_x": "1", "A": "a", "B": "a-$(MISSING)-$(A)", "PW": "pw", "RANK": "3", "POD": "job-trainer-0-x"}


def test_a_missing_secret_or_key_is_a_config_error_naming_it() -> None:
    for ref, needle in (({"name": "absent", "key": "k"}, "Secret absent"), ({"name": "s", "key": "nope"}, "'nope'")):
        container = {"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": ref}}]}
        with pytest.raises(PodSpecError, match=needle):
            container_env(POD, container, {"s": {"password": "pw"}}.get, {}.get)
    with pytest.raises(PodSpecError, match="no command"):
        container_argv({"name": "c"}, {})


def test_mount_paths_and_service_names_are_rewritten_whole() -> None:
    rewrite = path_rewriter({"/tmp": "/h/tmp", "/etc/rljob": "/h/cfg", "/data": "/h/data"})
    assert rewrite("/tmp/hf") == "/h/tmp/hf" and rewrite("/tmpx") == "/tmpx" and rewrite("/x/tmp") == "/x/tmp"
    assert rewrite("/etc/rljob/job.yaml") == "/h/cfg/job.yaml"
    assert rewrite("exec redis-server --dir /data --port 6379") == "exec redis-server --dir /h/data --port 6379"
    assert rewrite("redis://job-redis.ns.svc:6379/0") == "redis://127.0.0.1:6379/0"
    assert rewrite("job-trainer-0.job-trainer.ns.svc.cluster.local") == "127.0.0.1"
    assert container_argv({"name": "c", "command": ["rljob", "$(ROLE)"], "args": ["x"]}, {"ROLE": "train"}) == [
        "rljob",
        "train",
        "x",
    ]


def test_projected_items_and_exit_codes() -> None:
    assert projected_files({"name": "v", "configMap": {"name": "cm"}}, {"a": "1"}) == {"a": "1"}
    items = {"name": "v", "secret": {"secretName": "s", "items": [{"key": "a", "path": "sub/b"}]}}
    assert projected_files(items, {"a": "1", "c": "2"}) == {"sub/b": "1"}
    assert exit_code(-9) == 137 and exit_code(-15) == 143 and exit_code(3) == 3
