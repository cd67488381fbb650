"""The local kubelet's pure pieces: $(VAR) expansion, env resolution, volumes, mount-path rewriting."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.kubelet_spec import (
    SKIPPED_NOTE,
    ContainerConfigError,
    Mount,
    PodRefs,
    container_env,
    container_launch,
    expand,
    field_value,
    parse_quantity,
    referenced_objects,
    resource_value,
    rewrite_paths,
    volume_files,
)

pytestmark = pytest.mark.unit


def _pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x", "tier": "a b"}},
        "spec": {"nodeName": "warmpool-node-0", "containers": [], **spec},
        "status": {"podIP": "127.10.0.7", "podIPs": [{"ip": "127.10.0.7"}], "hostIP": "127.0.0.1"},
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)z", "x1y2z"),
        ("$$(A)", "$(A)"),  # escaped
        ("$$$(A)", "$1"),
        ("$(MISSING)", "$(MISSING)"),  # unknown names stay as written
        ("$()", "$()"),
        ("$(A", "$(A"),  # unclosed stays literal
        ("cost $5", "cost $5"),
        ("trailing $", "trailing $"),
        ("$A", "$A"),  # shell syntax is not expanded
        ("", ""),
    ],
)
def test_expand_like_kubelet(text: str, expected: str) -> None:
    assert expand(text, {"A": "1", "B": "2"}) == expected


def test_env_order_value_from_and_env_from() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}, {"secretRef": {"name": "sec"}}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(IP):8080/$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}}},
        ],
    }
    refs = PodRefs({"cm": {"k": b"v", "bad key": b"skipped"}}, {"sec": {"password": b"s3cret"}})
    env = container_env(_pod(), container, refs)
    assert env["URL"] == "http://127.10.0.7:8080/$(LATER)"  # only earlier variables expand
    assert env["CM_k"] == "v" and "CM_bad key" not in env
    assert env["password"] == "s3cret" and env["PW"] == "s3cret"
    assert (env["IP"], env["NAME"], env["NS"], env["NODE"], env["APP"], env["K"]) == (
        "127.10.0.7", "p", "ns", "warmpool-node-0", "x", "v")
    assert "OPT" not in env


def test_missing_config_is_a_config_error() -> None:
    container = {"name": "c", "env": [{"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}
    with pytest.raises(ContainerConfigError, match='configmap "cm" not found'):
        container_env(_pod(), container, PodRefs({"cm": None}, {}))
    with pytest.raises(ContainerConfigError, match="couldn't find key k"):
        container_env(_pod(), container, PodRefs({"cm": {}}, {}))


def test_downward_labels_format_and_quantities() -> None:
    assert field_value(_pod(), "metadata.labels") == 'app="x"\ntier="a b"'
    assert parse_quantity("500m") == 0.5 and parse_quantity("1Gi") == 2**30 and parse_quantity("2e3") == 2000
    container = {"resources": {"limits": {"cpu": "1500m", "memory": "1Gi"}}}
    assert resource_value(container, {"resource": "limits.cpu"}) == "2"  # ceil, like the kubelet
    assert resource_value(container, {"resource": "limits.memory", "divisor": "1Mi"}) == "1024"


def test_volume_files_for_each_kind() -> None:
    pod = _pod(containers=[{"name": "c"}])
    refs = PodRefs({"cm": {"a": b"1", "b": b"2"}}, {"sec": {"tls.key": b"KEY"}})
    assert volume_files(pod, {"name": "v", "configMap": {"name": "cm"}}, refs) == {
        "a": (b"1", 0o644), "b": (b"2", 0o644)}
    items = {"name": "v", "configMap": {"name": "cm", "items": [{"key": "b", "path": "sub/b.txt", "mode": 0o600}]}}
    assert volume_files(pod, items, refs) == {"sub/b.txt": (b"2", 0o600)}
    assert volume_files(pod, {"name": "v", "secret": {"secretName": "sec", "defaultMode": 0o400}}, refs) == {
        "tls.key": (b"KEY", 0o400)}
    item = {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}}
    downward = {"name": "v", "downwardAPI": {"items": [item]}}
    assert volume_files(pod, downward, refs) == {"ns": (b"ns", 0o644)}
    assert volume_files(pod, {"name": "v", "emptyDir": {}}, refs) is None
    with pytest.raises(ContainerConfigError):
        volume_files(pod, {"name": "v", "configMap": {"name": "missing"}}, PodRefs({"missing": None}, {}))
    assert volume_files(pod, {"name": "v", "configMap": {"name": "missing", "optional": True}},
                        PodRefs({"missing": None}, {})) == {}


def test_projected_service_account_volume_is_lenient() -> None:
    volume = {
        "name": "kube-api-access-abcde",
        "projected": {"sources": [
            {"serviceAccountToken": {"path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
        ]},
    }
    files = volume_files(_pod(), volume, PodRefs({"kube-root-ca.crt": None}, {}, {"|3600": b"TOKEN"}))
    assert files is not None
    assert files["namespace"] == (b"ns", 0o644)
    assert files["token"] == (b"TOKEN", 0o600)  # owner-only: nothing else isolates it locally
    assert "ca.crt" not in files and SKIPPED_NOTE not in files


def test_projected_token_not_issued_holds_the_pod_back() -> None:
    volume = {"name": "kube-api-access-abcde",
              "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}
    with pytest.raises(ContainerConfigError, match="no token issued yet"):
        volume_files(_pod(), volume, PodRefs({}, {}, {"|3600": b"other"}))


def test_unsupported_projected_source_is_noted() -> None:
    volume = {"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "ca"}}]}}
    files = volume_files(_pod(), volume, PodRefs())
    assert files is not None
    assert b"clusterTrustBundle" in files[SKIPPED_NOTE][0]


def test_referenced_objects() -> None:
    pod = _pod(
        containers=[{"name": "c", "envFrom": [{"secretRef": {"name": "s1"}}],
                     "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}}]}],
        volumes=[{"name": "a", "configMap": {"name": "c2"}}, {"name": "b", "secret": {"secretName": "s2"}},
                 {"name": "p", "projected": {"sources": [{"configMap": {"name": "c3"}}]}}],
    )
    assert referenced_objects(pod) == ({"c1", "c2", "c3"}, {"s1", "s2"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/etc/conf/app.yaml", "/L/conf/app.yaml"),
        ("/etc/conf", "/L/conf"),
        ("--config=/etc/conf/a,/data/x", "--config=/L/conf/a,/L/data/x"),
        ("/database", "/database"),  # not a path boundary
        ("/x/data", "/x/data"),  # not at the start of a path
        ("/etc/conf/extra/f", "/L/extra/f"),  # the longest (nested) mount wins
        ("/etc/confidential", "/etc/confidential"),
        ("a /data b", "a /L/data b"),
    ],
)
def test_rewrite_paths(text: str, expected: str) -> None:
    mounts = [Mount("/etc/conf", "/L/conf"), Mount("/data", "/L/data"), Mount("/etc/conf/extra", "/L/extra")]
    assert rewrite_paths(text, mounts) == expected


def test_container_launch_rewrites_command_env_and_subpath(tmp_path: Path) -> None:
    container = {
        "name": "c",
        "command": ["python3", "-m", "app", "--model=$(MODEL_DIR)/w.safetensors"],
        "args": ["--conf", "/etc/app/settings.yaml", "$(IP)"],
        "env": [
            {"name": "MODEL_DIR", "value": "/models/llama"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "workingDir": "/models",
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "conf", "mountPath": "/etc/app/settings.yaml", "subPath": "settings.yaml"},
        ],
    }
    paths = {"models": Path("/srv/models"), "conf": tmp_path / "conf"}
    launch = container_launch(_pod(), container, PodRefs(), paths)
    assert launch.argv == [
        "python3", "-m", "app", "--model=/srv/models/llama/w.safetensors",
        "--conf", str(tmp_path / "conf" / "settings.yaml"), "127.10.0.7",
    ]
    assert launch.env["MODEL_DIR"] == "/srv/models/llama"
    assert launch.working_dir == "/srv/models"


def test_secret_base64_is_decoded() -> None:
    from warmpool_devcluster.kubelet_spec import secret_data

    assert secret_data({"data": {"k": base64.b64encode(b"\x00bin").decode()}}) == {"k": b"\x00bin"}
