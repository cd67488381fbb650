"""The Helm chart, offline: lint, render with several value sets, validate every rendered
object with kubeconform (strict) against the Kubernetes 1.34 schemas of the running API
server and our CRD's schema, refuse bad values with the schema's message, and keep the
chart's conventions (every value commented, every RBAC rule commented, strict schema).

kubeconform's schemas are generated from the API server's /openapi/v2 (below): GitHub, where
kubeconform would download them from, is not reachable here.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build
from warmpool_devcluster.chart_values import render_only_set_flags, render_only_values
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.rules import status
from warmpool_operator.rules.forecast import report as forecast_report

from tests.support.contract_names import contract_values
from warmpool.contract.api import API_GROUP, CONDITION_TYPES, KIND
from warmpool.contract.http import PATH_METRICS, WORKER_PORT_NAME
from warmpool.contract.metrics import (
    METRIC_MEMORY_USED_RATIO,
    METRIC_OPERATOR_RECONCILE_ERRORS,
    METRIC_OPERATOR_WARM_PODS,
    METRIC_PHASE_DURATION,
    METRIC_TIER,
    METRIC_TTFT,
)
from warmpool.contract.nodecache import CACHE_NODE_LABEL_PREFIX
from warmpool.contract.pods import (
    ANNOTATION_POD_DELETION_COST,
    ANNOTATION_TIER,
    COMPONENT_WORKER,
    CONTROL_SECRET_SUFFIX,
    LABEL_AWAKE,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    WORKER_POLICY_SUFFIX,
)
from warmpool.contract.telemetry import ENV_OTEL_ENDPOINT
from warmpool.contract.zero import (
    ACTIVATOR_SLICE_SUFFIX,
    COMPONENT_ACTIVATOR,
    DEFAULT_ACTIVATOR_PORT,
    ENDPOINTSLICE_MANAGER,
    HELD_ANNOTATION_PREFIX,
    HELD_CLOCK_SKEW_SECONDS,
    HELD_COUNT_MAX,
    LABEL_ENDPOINTSLICE_MANAGED_BY,
    LABEL_SERVICE_NAME,
    MAX_UNIX_SECONDS,
    PODS_SLICE_SUFFIX,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "warmpool"
CRD_FILE = REPO / "crds" / "warmmodels.warmpool.dev.yaml"
#: Kinds whose schemas no offline source has (the Prometheus Operator's CRDs are not part of
#: this repository or the cluster): kubeconform skips them; test_monitors checks them.
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")

Obj = dict[str, Any]


def _bin(name: str) -> str:
    return str(build.ensure_binaries([name])[name])


#: The Kubernetes version `helm template` renders for (Chart.yaml's kubeVersion is checked against
#: it): the dev cluster's.  Our helm is built without the version stamps a released helm carries, so
#: left to itself it would claim v1.20.0 and refuse the chart.
KUBE_VERSION = build.KUBERNETES_VERSION


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if args[:1] == ("template",) and "--kube-version" not in args:
        args = (*args, "--kube-version", KUBE_VERSION)
    proc = subprocess.run([_bin("helm"), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(tmp_path: Path, values: Mapping[str, Any] | None = None, namespace: str = "warmpool-system") -> str:
    args = ["template", "wp", str(CHART), "--namespace", namespace]
    if values is not None:
        path = tmp_path / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
        path.write_text(yaml.safe_dump(render_only_values(values)))
        args += ["-f", str(path)]
    else:
        args += render_only_set_flags()
    return helm(*args).stdout


def objects(manifest: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def by_kind(objs: Sequence[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


@pytest.fixture(scope="module")
def schema_dir(api_server: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kubeconform's schemas: every built-in kind of a running 1.34 API server, and WarmModel."""
    out = tmp_path_factory.mktemp("kubeconform-schemas")
    version = json.loads(api_server.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert (version["major"], version["minor"].rstrip("+")) == ("1", "34"), version
    assert version["gitVersion"] == KUBE_VERSION, (version, KUBE_VERSION)
    openapi = json.loads(api_server.kubectl("get", "--raw", "/openapi/v2", timeout=60).stdout)
    assert write_kubernetes_schemas(openapi, out) > 100
    write_crd_schemas(yaml.safe_load(CRD_FILE.read_text()), out)
    return out


def kubeconform(schema_dir: Path, manifest: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_bin("kubeconform"), "-strict", "-summary", "-output", "text", "-kubernetes-version", KUBE_VERSION.lstrip("v"),
         "-schema-location", str(schema_dir / LOCATION_TEMPLATE), "-skip", ",".join(MONITOR_KINDS), *extra, "-"],
        input=manifest, capture_output=True, text=True, timeout=120,
    )


def assert_valid(schema_dir: Path, manifest: str) -> None:
    proc = kubeconform(schema_dir, manifest)
    assert proc.returncode == 0, f"kubeconform:\n{proc.stdout}\n{proc.stderr}"
    assert "Invalid: 0, Errors: 0" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- offline schemas

# Offline JSON schemas for kubeconform, from the running API server and from our CRD.
#
# kubeconform normally downloads its schemas (yannh/kubernetes-json-schema, made by
# openapi2jsonschema) from GitHub, which this machine cannot reach.  The same files can be
# made locally: the API server publishes every built-in kind's schema at ``/openapi/v2``,
# and our CRD carries its own ``openAPIV3Schema``.  These functions write one standalone file
# per kind, in the layout kubeconform's ``-schema-location`` template names:
#
#     <dir>/{{ .ResourceKind }}{{ .KindSuffix }}.json     e.g. deployment-apps-v1.json,
#                                                               configmap-v1.json,
#                                                               warmmodel-warmpool-v1alpha1.json
#
# "strict" the way ``openapi2jsonschema --strict`` makes it: every object schema that lists
# its properties refuses others (``additionalProperties: false``), so a misspelt field in a
# rendered manifest fails validation.  Kubernetes' "int-or-string" and Quantity types, which
# the OpenAPI document types as strings, accept numbers too (``port: 8080``, ``cpu: 1``).

Schema = dict[str, Any]

#: kubeconform's template for the files written here (pass with -schema-location).
LOCATION_TEMPLATE = "{{ .ResourceKind }}{{ .KindSuffix }}.json"

_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def file_name(group: str, version: str, kind: str) -> str:
    """The file kubeconform looks for (see schemaPath in kubeconform's pkg/registry)."""
    suffix = f"-{group.split('.')[0].lower()}-{version.lower()}" if group else f"-{version.lower()}"
    return f"{kind.lower()}{suffix}.json"


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` in which every object with properties refuses unknown ones.

    Walks schema positions only (a property may be *named* "oneOf" or "properties", as in
    the CRD kind's own JSONSchemaProps), so keywords are never confused with field names.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub) for name, sub in out[key].items()}
    for key in ("additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    elif isinstance(out.get("items"), list):
        out["items"] = [_strict(sub) for sub in out["items"]]
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [_strict(sub) for sub in out[key]]
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "string"}, {"type": "integer"}]
    preserve = bool(out.get("x-kubernetes-preserve-unknown-fields"))
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def _refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")  # a field named "$ref" (JSONSchemaProps) holds a dict: skipped
        if isinstance(ref, str) and ref.startswith("#/definitions/"):
            yield ref.removeprefix("#/definitions/")
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _closure(definitions: Mapping[str, Schema], root: str) -> dict[str, Schema]:
    """``root`` and every definition it reaches through $ref."""
    seen: dict[str, Schema] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in definitions:
            continue
        seen[name] = definitions[name]
        todo.extend(_refs(definitions[name]))
    return seen


def write_kubernetes_schemas(openapi_v2: Mapping[str, Any], out_dir: Path) -> int:
    """One strict standalone schema per built-in kind; returns how many were written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    definitions: dict[str, Schema] = copy.deepcopy(dict(openapi_v2["definitions"]))
    definitions[_INT_OR_STRING] = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    definitions[_QUANTITY] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    written = 0
    for name, schema in definitions.items():
        gvks = schema.get("x-kubernetes-group-version-kind") or []
        if len(gvks) != 1:  # shared types (DeleteOptions, WatchEvent) are no manifest's kind
            continue
        gvk = gvks[0]
        reached = _closure(definitions, name)
        standalone: Schema = _strict(reached.pop(name))
        standalone["definitions"] = {key: _strict(value) for key, value in reached.items()}
        standalone["$schema"] = "http://json-schema.org/schema#"
        path = out_dir / file_name(str(gvk.get("group", "")), str(gvk["version"]), str(gvk["kind"]))
        path.write_text(json.dumps(standalone))
        written += 1
    return written


def write_crd_schemas(crd: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """One strict schema per served version of a CustomResourceDefinition."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = crd["spec"]
    paths: list[Path] = []
    for version in spec["versions"]:
        schema: Schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
        # The CRD's schema leaves the envelope loose; a manifest's envelope is fixed.
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "enum": [f"{spec['group']}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [spec["names"]["kind"]]}
        props["metadata"] = {"type": "object"}
        schema["$schema"] = "http://json-schema.org/schema#"
        path = out_dir / file_name(spec["group"], version["name"], spec["names"]["kind"])
        path.write_text(json.dumps(schema))
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- lint and render

#: Value sets that between them switch every template branch on and off.
VALUE_SETS: dict[str, Obj] = {
    "defaults": {},
    "cluster-wide, everything on": {
        "watch": {"allNamespaces": True},
        "crds": {"install": True, "keep": False},
        "metrics": {
            "service": {"enabled": True},
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
            "podMonitor": {"enabled": True, "interval": "10s", "labels": {"release": "prom"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
        },
        "dashboard": {"enabled": True, "namespace": "monitoring", "labels": {"grafana_dashboard": "1"}},
        "operator": {"scrapeNetworks": ["10.0.0.0/8", "fd00::/8"], "logLevel": "DEBUG",
                     "extraEnv": [{"name": "A", "value": "b"},
                                  {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
    },
    "namespaced, bring your own": {
        "watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b", "team-c"]},
        "crds": {"install": False, "keep": True},
        "image": {"repository": "registry.example/warmpool/operator", "digest": "sha256:" + "a" * 64,
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"create": False, "name": "preexisting"},
        "resources": {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["system"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"team": "ml"},
        "metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": False},
                    "podMonitor": {"enabled": True}},
    },
    "no RBAC, renamed": {"rbac": {"create": False}, "fullnameOverride": "wpop", "dashboard": {"enabled": True}},
}


def test_helm_lint() -> None:
    for values in ({}, VALUE_SETS["cluster-wide, everything on"]):
        args = ["lint", "--strict", str(CHART)]
        for key, value in _flatten(render_only_values(values)):
            args += ["--set-json", f"{key}={json.dumps(value)}"]
        proc = helm(*args)
        assert "0 chart(s) failed" in proc.stdout, proc.stdout


def _flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in ("labels", "nodeSelector", "affinity", "resources"):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_objects_are_valid(name: str, schema_dir: Path, tmp_path: Path) -> None:
    manifest = render(tmp_path, VALUE_SETS[name])
    assert_valid(schema_dir, manifest)
    objs = objects(manifest)
    for obj in objs:  # the standard labels on every object, from _helpers.tpl
        labels = obj["metadata"].get("labels") or {}
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']} lacks label {key}"
    (deployment,) = _not_activator(by_kind(objs, "Deployment"))
    spec = deployment["spec"]
    # Two replicas, one acting through the leader Lease, and a PDB keeping one.
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    (pdb,) = _not_activator(by_kind(objs, "PodDisruptionBudget"))
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["warmpool", "operator"]
    assert "--leader-elect" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    _assert_restricted(pod)


def _assert_restricted(pod: Mapping[str, Any]) -> None:
    """Pod Security "restricted" as the admission plugin checks it (the install test proves it)."""
    pod_sc = pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True
    assert all(set(v) & {"emptyDir", "secret", "configMap", "projected"} for v in pod.get("volumes", []))


def test_kubeconform_schemas_are_strict(schema_dir: Path) -> None:
    """The negative control: a misspelt field and a wrong type are caught, so 'valid' means something."""
    bad = yaml.safe_dump_all([
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
         "spec": {"replicaz": 1, "selector": {"matchLabels": {"a": "b"}},
                  "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}}},
        {"apiVersion": "warmpool.dev/v1alpha1", "kind": "WarmModel", "metadata": {"name": "y"},
         "spec": {"model": {"hostPath": {"path": "/m"}}, "pool": {"replicas": "three"}}},
    ])
    proc = kubeconform(schema_dir, bad)
    assert proc.returncode != 0
    assert "replicaz" in proc.stdout, proc.stdout
    assert "Invalid: 2" in proc.stdout, proc.stdout


def test_examples_match_the_crd_schema(schema_dir: Path) -> None:
    manifest = "\n---\n".join(p.read_text() for p in sorted((REPO / "examples").glob("*.yaml")))
    assert_valid(schema_dir, manifest)


def _not_activator(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if not o["metadata"]["name"].endswith(("-activator", "-activator-callers"))
            and not _aggregated(o)]


#: The labels that add a ClusterRole's rules to the built-in view, edit and admin ClusterRoles.
AGGREGATE_TO = {f"rbac.authorization.k8s.io/aggregate-to-{role}": role for role in ("view", "edit", "admin")}


def _aggregated(obj: Obj) -> bool:
    """One of the ClusterRoles for users (aggregated into view/edit/admin), not the chart's own accounts'."""
    return bool(set(obj["metadata"].get("labels") or {}) & set(AGGREGATE_TO))


def _leader(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith("-leader")]


def _not_leader(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in _not_activator(by_kind(objs, kind)) if not o["metadata"]["name"].endswith(
        ("-leader", "-node-leases"))]


def _node_leases(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith("-node-leases")]


def assert_node_leases_read_only_in_kube_node_lease(objs: list[dict[str, Any]], account: str,
                                                    namespace: str) -> None:
    """The kubelets' Leases (control/nodes.py): read, in kube-node-lease only, by the operator's account."""
    (role,) = _node_leases(objs, "Role")
    (binding,) = _node_leases(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "kube-node-lease"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]


def test_rbac_by_scope(tmp_path: Path) -> None:
    namespaced = objects(render(tmp_path, VALUE_SETS["namespaced, bring your own"]))
    # The leader Lease's Role lives in the release namespace, whatever the scope.
    (leader,) = _leader(namespaced, "Role")
    assert leader["metadata"]["namespace"] == "warmpool-system"
    assert leader["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
        # The control key, beside the Lease: read by name (the only Secret the operator reads), made once.
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["wp-warmpool-control-key"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        # The activator's addresses: its Service's EndpointSlices, read where the activator runs.
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    args = _not_activator(by_kind(namespaced, "Deployment"))[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--control-key-secret=wp-warmpool-control-key", "--control-key-namespace=warmpool-system"} <= set(args)
    assert [b["metadata"]["namespace"] for b in _leader(namespaced, "RoleBinding")] == ["warmpool-system"]
    assert_node_leases_read_only_in_kube_node_lease(namespaced, "preexisting", "warmpool-system")
    watched = ["team-a", "team-b", "team-c"]
    roles = _not_leader(namespaced, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == watched
    assert sorted(b["metadata"]["namespace"] for b in _not_leader(namespaced, "RoleBinding")) == watched
    for binding in _not_activator(by_kind(namespaced, "RoleBinding") + by_kind(namespaced, "ClusterRoleBinding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "preexisting",
                                        "namespace": "warmpool-system"}]
    (discovery,) = _not_activator(by_kind(namespaced, "ClusterRole"))
    assert {r for rule in discovery["rules"] for r in rule["resources"]} == {"customresourcedefinitions",
                                                                              "namespaces", "nodes"}
    args = _not_activator(by_kind(namespaced, "Deployment"))[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={ns}" for ns in watched]
    assert [a["metadata"]["name"] for a in by_kind(namespaced, "ServiceAccount")] == ["wp-warmpool-activator"]
    # The activator's scope is the operator's: the same namespaces, a Role and RoleBinding in each.
    assert [a for a in _activator(namespaced, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
            if a.startswith("--namespace")] == [f"--namespace={ns}" for ns in watched]
    activator_roles = [o for o in by_kind(namespaced, "Role") if o["metadata"]["name"] == "wp-warmpool-activator"]
    assert sorted(r["metadata"]["namespace"] for r in activator_roles) == watched
    for binding in [o for o in by_kind(namespaced, "RoleBinding") if o["metadata"]["name"] == "wp-warmpool-activator"]:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "wp-warmpool-activator",
                                        "namespace": "warmpool-system"}]

    default = objects(render(tmp_path, {}, namespace="ops"))
    assert [r["metadata"]["namespace"] for r in _not_leader(default, "Role")] == ["ops"]
    assert [r["metadata"]["namespace"] for r in _leader(default, "Role")] == ["ops"]

    wide = objects(render(tmp_path, VALUE_SETS["cluster-wide, everything on"]))
    assert not _not_leader(wide, "Role") and not _not_leader(wide, "RoleBinding")
    assert_node_leases_read_only_in_kube_node_lease(wide, "wp-warmpool", "warmpool-system")
    assert len(_leader(wide, "Role")) == 1 and len(_leader(wide, "RoleBinding")) == 1
    cluster_roles = {r["metadata"]["name"]: r for r in by_kind(wide, "ClusterRole") if not _aggregated(r)}
    assert set(cluster_roles) == {"wp-warmpool", "wp-warmpool-discovery", "wp-warmpool-activator",
                                  "wp-warmpool-activator-callers"}
    # Cluster-wide kopf never lists namespaces: no rule for them.
    assert {r for rule in cluster_roles["wp-warmpool-discovery"]["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions", "nodes"}
    # Nodes read in either scope (node loss and drains, control/nodes.py), never written.
    for roles in (_not_activator(by_kind(namespaced, "ClusterRole")), [cluster_roles["wp-warmpool-discovery"]]):
        assert [r["verbs"] for role in roles for r in role["rules"] if "nodes" in r["resources"]] == [
            ["get", "list", "watch"]]
    args = _not_activator(by_kind(wide, "Deployment"))[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    activator_args = _activator(wide, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in activator_args and not any(a.startswith("--namespace") for a in activator_args)
    (activator_binding,) = [b for b in by_kind(wide, "ClusterRoleBinding")
                            if b["metadata"]["name"] == "wp-warmpool-activator"]
    assert activator_binding["roleRef"]["name"] == "wp-warmpool-activator"

    assert not [o for o in objects(render(tmp_path, {"rbac": {"create": False}}))
                if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]


def test_rbac_grants_no_deletes_no_secret_listing(tmp_path: Path) -> None:
    for name in ("defaults", "cluster-wide, everything on"):
        for role in [o for o in objects(render(tmp_path, VALUE_SETS[name]))
                     if o["kind"] in ("Role", "ClusterRole") and not _aggregated(o)]:
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                # The one delete: the EndpointSlices of a pool that dropped scaleToZero.
                deletes = {"delete"} if rule["resources"] == ["endpointslices"] else set()
                assert not ({"delete", "deletecollection", "escalate", "bind", "impersonate"} - deletes) & set(
                    rule["verbs"]), rule
                if "secrets" in rule["resources"]:
                    assert not {"list", "watch"} & set(rule["verbs"]), rule
                    # Read only by name: the operator's control key, the node agent's S3 credentials.
                    if "get" in rule["verbs"] and "-node-agent" not in role["metadata"]["name"]:
                        assert rule.get("resourceNames") == ["wp-warmpool-control-key"], (role["metadata"], rule)


def test_every_rbac_rule_is_commented() -> None:
    """Each rule in rbac.yaml has a comment right above it saying who needs it, [kopf] or [warmpool]."""
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    rules = [i for i, line in enumerate(lines) if line.lstrip().startswith("- apiGroups:")]
    assert len(rules) >= 10
    for i in rules:
        j = i - 1
        while lines[j].strip().startswith("{{"):  # template control lines between comment and rule
            j -= 1
        above = lines[j].strip()
        assert above.startswith("#"), f"rbac.yaml line {i + 1}: rule without a comment"
        block = [lines[k] for k in range(j, 0, -1) if lines[k].strip().startswith("#")]
        assert any("[kopf]" in c or "[warmpool]" in c for c in block), f"rbac.yaml line {i + 1}: whose need?"


def test_chart_crd_is_the_repositorys_crd(tmp_path: Path) -> None:
    """files/crds/ links to crds/ (Helm reads nothing outside the chart; `helm package` stores
    the linked content), and the template renders that CRD unchanged."""
    link = CHART / "files" / "crds" / CRD_FILE.name
    assert link.resolve() == CRD_FILE.resolve(), "files/crds/ must link to the generated crds/ file"
    (crd,) = by_kind(objects(render(tmp_path, {})), "CustomResourceDefinition")
    source = yaml.safe_load(CRD_FILE.read_text())
    assert json.loads(json.dumps(crd["spec"])) == json.loads(json.dumps(source["spec"]))
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (crd,) = by_kind(objects(render(tmp_path, {"crds": {"install": True, "keep": False}})), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
    assert not by_kind(objects(render(tmp_path, {"crds": {"install": False, "keep": True}})),
                       "CustomResourceDefinition")


def test_monitors_and_dashboard(tmp_path: Path) -> None:
    objs = objects(render(tmp_path, VALUE_SETS["cluster-wide, everything on"]))
    (service_monitor,) = by_kind(objs, "ServiceMonitor")
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert service_monitor["metadata"]["labels"]["release"] == "prom"
    (service,) = _not_activator(by_kind(objs, "Service"))
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    # The workers' PodMonitor; the activator's (and the node agent's) are tests/integration/test_chart_monitoring.py's.
    (pod_monitor,) = [m for m in by_kind(objs, "PodMonitor") if m["metadata"]["name"].endswith("-workers")]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    # The labels the operator puts on worker pods, and the port it names.
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {
        LABEL_COMPONENT: COMPONENT_WORKER, LABEL_MANAGED_BY: MANAGED_BY}
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["path"] == PATH_METRICS

    (dashboard_cm,) = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert dashboard_cm["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(dashboard_cm["data"]["warmpool.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (METRIC_PHASE_DURATION, METRIC_TIER, METRIC_MEMORY_USED_RATIO,
                   METRIC_TTFT, METRIC_OPERATOR_WARM_PODS, METRIC_OPERATOR_RECONCILE_ERRORS):
        assert metric in exprs, f"dashboard lacks {metric}"
    for word in re.findall(r"warmpool_[a-z_]+", exprs):  # no invented metric names
        base = re.sub(r"_(bucket|count|sum)$", "", word)
        assert base in contract_values().values(), f"dashboard uses {word}, which warmpool/contract/ does not name"


def _operator_args(tmp_path: Path, values: Mapping[str, Any] | None = None) -> list[str]:
    (deployment,) = _not_activator(by_kind(objects(render(tmp_path, values)), "Deployment"))
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_allowed_host_paths_become_operator_flags(tmp_path: Path) -> None:
    from warmpool_operator.app.cli import build_parser
    from warmpool_operator.rules.host_paths import DEFAULT_ALLOWED_HOST_PATHS, normalise_prefixes

    defaults = _operator_args(tmp_path)
    assert [a for a in defaults if a.startswith("--allowed-host-path")] == [
        f"--allowed-host-path={path}" for path in DEFAULT_ALLOWED_HOST_PATHS]
    custom = _operator_args(tmp_path, {"operator": {"allowedHostPaths": ["/data/models/", "/mnt/a:b#c"]}})
    # The rendered flags parse with the operator's own parser (quoted: ':' and '#' survive YAML).
    parsed = build_parser().parse_args(custom)
    assert parsed.allowed_host_path == ["/data/models/", "/mnt/a:b#c"]
    assert normalise_prefixes(parsed.allowed_host_path) == ("/data/models", "/mnt/a:b#c")


def test_node_agent_daemonset_and_its_rbac(schema_dir: Path, tmp_path: Path) -> None:
    """nodeAgent.enabled: a valid DaemonSet running `warmpool node-agent` on the cache root the
    operator mounts, with RBAC of its own that reads Secrets by name only and deletes nothing."""
    assert not by_kind(objects(render(tmp_path, {})), "DaemonSet")
    values = {"nodeAgent": {"enabled": True, "cacheRoot": "/var/lib/warmpool/blocks", "budgetBytes": 10**12,
                            "tolerations": [{"operator": "Exists"}]}}
    manifest = render(tmp_path, values)
    assert_valid(schema_dir, manifest)
    objs = objects(manifest)
    (daemonset,) = by_kind(objs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["warmpool", "node-agent"]
    assert "--cache-root=/var/lib/warmpool/blocks" in container["args"]
    assert "--budget-bytes=1000000000000" in container["args"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/var/lib/warmpool/blocks"
    assert [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v] == ["/var/lib/warmpool/blocks"]
    # Its own PID namespace, and no ptrace: other containers' /proc/<pid>/root is out of its reach.
    assert "hostPID" not in pod and "hostNetwork" not in pod
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "--block-cache-root=/var/lib/warmpool/blocks" in _operator_args(tmp_path, values)
    from warmpool_nodecache.agent_cli import build_parser

    parsed = build_parser().parse_args(container["args"])  # the rendered flags are the agent's own
    assert str(parsed.cache_root) == "/var/lib/warmpool/blocks"
    agent_roles = [o for o in objs if o["kind"] in ("Role", "ClusterRole") and "-node-agent" in o["metadata"]["name"]]
    assert len(agent_roles) == 4
    # It finds the cluster's networks itself: every Node, the ServiceCIDRs, the kubernetes Service by name.
    rules = [(o["metadata"].get("namespace"), r) for o in agent_roles for r in o["rules"]]
    assert any("nodes" in r["resources"] and "list" in r["verbs"] for _, r in rules), rules
    assert any(r["resources"] == ["servicecidrs"] and r["verbs"] == ["list"] for _, r in rules), rules
    assert [(ns, r.get("resourceNames")) for ns, r in rules if "services" in r["resources"]] == [
        ("default", ["kubernetes"])]
    assert "--cluster-networks-refresh=60" in container["args"]
    # Its Warning Events, on WarmModels in any namespace and on its Node (in "default").
    assert [(ns, r["verbs"]) for ns, r in rules if "events" in r["resources"]] == [(None, ["create"])], rules
    for role in agent_roles:
        for rule in role["rules"]:
            assert not {"delete", "deletecollection", "escalate", "bind"} & set(rule["verbs"]), rule
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["get"], rule
                # Namespaced mode: the S3 credentials are readable in the watched namespace only.
                assert role["kind"] == "Role" and role["metadata"]["namespace"] == "warmpool-system", role


def _agent_secret_roles(tmp_path: Path, watch: Mapping[str, Any],
                        secret_namespaces: Sequence[str] = ()) -> list[tuple[str, str | None]]:
    objs = objects(render(tmp_path, {"watch": dict(watch), "nodeAgent": {
        "enabled": True, "secretNamespaces": list(secret_namespaces)}}))
    return sorted((o["kind"], o["metadata"].get("namespace")) for o in objs
                  if o["kind"] in ("Role", "ClusterRole") and "-node-agent" in o["metadata"]["name"]
                  and any("secrets" in rule["resources"] for rule in o["rules"]))


def test_the_node_agent_reads_secrets_only_where_warmmodels_are_watched(tmp_path: Path) -> None:
    assert _agent_secret_roles(tmp_path, {"namespaces": ["team-a", "team-b"]}) == [
        ("Role", "team-a"), ("Role", "team-b")]
    assert _agent_secret_roles(tmp_path, {"allNamespaces": True}) == [("ClusterRole", None)]
    # Named namespaces narrow it in either mode: cluster-wide, the agent then reads no other Secret.
    assert _agent_secret_roles(tmp_path, {"allNamespaces": True}, ["models"]) == [("Role", "models")]
    assert _agent_secret_roles(tmp_path, {"namespaces": ["team-a", "team-b"]}, ["team-b"]) == [("Role", "team-b")]


def test_admission_policies_name_the_contracts_keys_and_can_be_left_out(tmp_path: Path) -> None:
    objs = objects(render(tmp_path, {"nodeAgent": {"enabled": True}}))
    policies = {o["metadata"]["name"]: o for o in by_kind(objs, "ValidatingAdmissionPolicy")}
    assert set(policies) == {"wp-warmpool-operator-pod-patches", "wp-warmpool-operator-secret-writes",
                             "wp-warmpool-node-agent-own-node", "wp-warmpool-activator-held-annotations",
                             "wp-warmpool-operator-endpointslices", "wp-warmpool-operator-endpointslice-services",
                             "wp-warmpool-owner-references", "wp-warmpool-warmmodel-host-paths"}
    # Cluster-wide mode, where the operator makes each pool's worker NetworkPolicy: one more.
    wide = objects(render(tmp_path, {"watch": {"allNamespaces": True}}))
    wide_policies = {o["metadata"]["name"]: o for o in by_kind(wide, "ValidatingAdmissionPolicy")}
    assert "wp-warmpool-operator-network-policies" in wide_policies
    network = json.dumps(wide_policies["wp-warmpool-operator-network-policies"])
    for key in (WORKER_POLICY_SUFFIX, LABEL_MANAGED_BY, MANAGED_BY, KIND, API_GROUP):
        assert key in network, key
    bindings = by_kind(objs, "ValidatingAdmissionPolicyBinding")
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(policies)
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)
    operator = json.dumps(policies["wp-warmpool-operator-pod-patches"])
    for key in (LABEL_MANAGED_BY, MANAGED_BY, LABEL_AWAKE, ANNOTATION_TIER,
                ANNOTATION_POD_DELETION_COST, "system:serviceaccount:warmpool-system:wp-warmpool"):
        assert key in operator, key
    secrets = json.dumps(policies["wp-warmpool-operator-secret-writes"])
    for key in (CONTROL_SECRET_SUFFIX, LABEL_MANAGED_BY, MANAGED_BY, KIND,
                API_GROUP):
        assert key in secrets, key
    agent = json.dumps(policies["wp-warmpool-node-agent-own-node"])
    for key in (CACHE_NODE_LABEL_PREFIX + "/", "system:serviceaccount:warmpool-system:wp-warmpool-node-agent"):
        assert key in agent, key
    assert not by_kind(objects(render(tmp_path, {"rbac": {"create": True, "admissionPolicies": False}})),
                       "ValidatingAdmissionPolicy")
    assert not by_kind(objects(render(tmp_path, {"rbac": {"create": False, "admissionPolicies": True}})),
                       "ValidatingAdmissionPolicy")


def _ingress_ports(policy: Obj) -> list[list[object]]:
    return [[port["port"] for port in rule["ports"]] for rule in policy["spec"]["ingress"]]


def test_network_policies_open_only_the_workers_port_and_the_operators(tmp_path: Path) -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    # Without the activator (its own policy and its peer on the workers: the next test).
    objs = objects(render(tmp_path, {"watch": {"namespaces": ["team-a", "team-b"]}, "activator": {"enabled": False},
                                     "networkPolicy": {"enabled": True, "workerClients": clients,
                                                       "workerNamespaces": [], "metricsClients": []}}))
    policies = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in by_kind(objs, "NetworkPolicy")}
    assert set(policies) == {("team-a", "wp-warmpool-workers"), ("team-b", "wp-warmpool-workers"),
                             ("warmpool-system", "wp-warmpool-operator")}
    workers = policies[("team-a", "wp-warmpool-workers")]["spec"]
    # The labels every worker pod carries, the port name its container declares (warmpool/contract/).
    assert workers["podSelector"] == {"matchLabels": {LABEL_COMPONENT: COMPONENT_WORKER,
                                                      LABEL_MANAGED_BY: MANAGED_BY}}
    assert workers["policyTypes"] == ["Ingress"]
    assert _ingress_ports(policies[("team-a", "wp-warmpool-workers")]) == [[WORKER_PORT_NAME]]
    operator_peer, *rest = workers["ingress"][0]["from"]
    assert operator_peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "warmpool-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "warmpool", "app.kubernetes.io/instance": "wp",
                                        "app.kubernetes.io/component": "operator"}}}
    assert rest == clients
    operator = policies[("warmpool-system", "wp-warmpool-operator")]
    assert _ingress_ports(operator) == [[9090], [8081]]
    assert "from" not in operator["spec"]["ingress"][0]  # metricsClients empty: anyone may scrape

    # Cluster-wide: only the namespaces named get the workers' policy (the chart cannot know them).
    wide = objects(render(tmp_path, {"watch": {"allNamespaces": True}, "activator": {"enabled": False},
                                     "networkPolicy": {"enabled": True, "workerClients": [],
                                                       "workerNamespaces": ["models"], "metricsClients": clients}}))
    names = sorted((o["metadata"]["namespace"], o["metadata"]["name"]) for o in by_kind(wide, "NetworkPolicy"))
    assert names == [("models", "wp-warmpool-workers"), ("warmpool-system", "wp-warmpool-operator")]
    wide_workers = next(o for o in by_kind(wide, "NetworkPolicy") if o["metadata"]["namespace"] == "models")
    assert len(wide_workers["spec"]["ingress"][0]["from"]) == 1  # the operator alone
    wide_operator = next(o for o in by_kind(wide, "NetworkPolicy") if o["metadata"]["namespace"] != "models")
    assert wide_operator["spec"]["ingress"][0]["from"] == clients
    assert not by_kind(objects(render(tmp_path, {"networkPolicy": {"enabled": False, "workerClients": [],
                                                                   "workerNamespaces": [], "metricsClients": []}})),
                       "NetworkPolicy")


WORKER_POLICY_FLAG = "--worker-policy-ingress="
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def _policy_rules(objs: list[Obj]) -> list[Obj]:
    """The ingress rules of the operator's --worker-policy-ingress, as the operator parses them."""
    from warmpool_operator.app.cli import build_parser, config_from_args

    (deployment,) = _not_activator(by_kind(objs, "Deployment"))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert len([a for a in args if a.startswith(WORKER_POLICY_FLAG)]) == 1, args
    rules = config_from_args(build_parser().parse_args(args)).worker_policy_ingress
    assert rules is not None
    return [dict(rule) for rule in rules]


def _network_policy_rules(objs: list[Obj]) -> list[Obj]:
    return [rule for role in by_kind(objs, "Role") + by_kind(objs, "ClusterRole") for rule in role["rules"]
            if "networkpolicies" in rule["resources"] and "create" in rule["verbs"]]


def test_cluster_wide_mode_has_the_operator_make_the_worker_policies(tmp_path: Path) -> None:
    """The chart cannot know cluster-wide mode's namespaces: by default it passes the operator the
    worker policy's rules (the very rules its namespaced policies carry, from the same values) and
    RBAC to write NetworkPolicies.  Namespaced mode, where the chart ships them, gets neither."""
    values: dict[str, Any] = {"metrics": {"podMonitor": {"enabled": True}},
                              "networkPolicy": {"metricsClients": PROMETHEUS}}
    wide = objects(render(tmp_path, {**values, "watch": {"allNamespaces": True}}))
    rules = _policy_rules(wide)
    (rbac,) = _network_policy_rules(wide)
    assert rbac["apiGroups"] == ["networking.k8s.io"] and "delete" not in rbac["verbs"]
    assert {"get", "list", "watch", "create", "patch"} <= set(rbac["verbs"])
    (cluster_role,) = [r for r in by_kind(wide, "ClusterRole") if rbac in r["rules"]]
    assert cluster_role["metadata"]["name"] == "wp-warmpool"  # bound cluster-wide
    # One place owns the rule: the namespaced mode's policy renders the same ingress.
    namespaced = objects(render(tmp_path, {**values, "watch": {"namespaces": ["team-a"]}}))
    (chart_policy,) = [o for o in by_kind(namespaced, "NetworkPolicy")
                       if o["metadata"]["name"] == "wp-warmpool-workers"]
    assert chart_policy["spec"]["ingress"] == rules
    assert not _network_policy_rules(namespaced)
    (deployment,) = _not_activator(by_kind(namespaced, "Deployment"))
    assert not [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith(WORKER_POLICY_FLAG)]
    # Off by value, or with no NetworkPolicies at all: neither flag nor RBAC.
    for off in ({"networkPolicy": {"operatorWorkerPolicies": False}}, {"networkPolicy": {"enabled": False}}):
        objs = objects(render(tmp_path, {"watch": {"allNamespaces": True}, **off}))
        assert not _network_policy_rules(objs)
        assert not [a for a in _operator_args(tmp_path, {"watch": {"allNamespaces": True}, **off})
                    if a.startswith(WORKER_POLICY_FLAG)]


def test_the_operators_worker_policy_admits_the_operator_activator_and_prometheus_only_on_the_workers_port(
        tmp_path: Path) -> None:
    """The policy the operator builds from the chart's flag, evaluated as the activator evaluates a
    pool's policies (activator/reach.py) for callers carrying the labels the chart gives its pods."""
    from warmpool_operator.activator import reach
    from warmpool_operator.api.types import parse_spec
    from warmpool_operator.model import Target
    from warmpool_operator.rules import builders

    def pod(deployment: Obj, namespace: str = "warmpool-system") -> reach.Caller:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        return reach.Caller("10.0.0.9", namespace, labels, {"kubernetes.io/metadata.name": namespace})

    def other(namespace: str) -> reach.Caller:
        return reach.Caller("10.0.0.8", namespace, {"app": "x"}, {"kubernetes.io/metadata.name": namespace})

    wm = Target("llama", "team-a", parse_spec({"model": {"hostPath": {"path": "/models/m"}}}))
    worker_port = reach.Target("team-a", builders.pod_labels("llama"), wm.spec.pod.port, WORKER_PORT_NAME)
    asleep = reach.Target("team-a", {**builders.pod_labels("llama"), LABEL_AWAKE: "false"}, wm.spec.pod.port,
                          WORKER_PORT_NAME)
    engine_port = reach.Target("team-a", builders.pod_labels("llama"), 8001, "engine")
    for podmonitor in (True, False):
        objs = objects(render(tmp_path, {"watch": {"allNamespaces": True},
                                         "metrics": {"podMonitor": {"enabled": podmonitor}},
                                         "networkPolicy": {"metricsClients": PROMETHEUS}}))
        policies = [builders.build_network_policy(wm, _policy_rules(objs))]
        operator = pod(_not_activator(by_kind(objs, "Deployment"))[0])
        activator = pod(_activator(objs, "Deployment"))
        prometheus = other("monitoring")
        for target in (worker_port, asleep):
            assert reach.admits(policies, target, operator) and reach.admits(policies, target, activator)
            assert reach.admits(policies, target, other("team-a"))  # workerClients' default: the pool's namespace
            assert not reach.admits(policies, target, other("team-b"))
            assert reach.admits(policies, target, prometheus) is podmonitor
        # The engine's own port is closed to all of them (the sidecar reaches it on loopback).
        for caller in (operator, activator, prometheus, other("team-a")):
            assert not reach.admits(policies, engine_port, caller)
        # The operator's and activator's labels from another namespace do not pass.
        assert not reach.admits(policies, worker_port, pod(_activator(objs, "Deployment"), "team-b"))


def _activator_callers(objs: list[dict[str, Any]]) -> Obj:
    (found,) = [o for o in by_kind(objs, "ClusterRole") if o["metadata"]["name"] == "wp-warmpool-activator-callers"]
    return found


def _activator(objs: list[dict[str, Any]], kind: str) -> Obj:
    (found,) = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == "wp-warmpool-activator"]
    return found


def test_the_activator_runs_restricted_beside_the_operator_which_routes_pools_at_zero_to_it(tmp_path: Path) -> None:
    objs = objects(render(tmp_path, {}))
    deployment = _activator(objs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = spec["selector"]["matchLabels"]
    assert labels[LABEL_COMPONENT] == COMPONENT_ACTIVATOR
    pod = spec["template"]["spec"]
    _assert_restricted(pod)
    assert pod["securityContext"]["runAsUser"] == 65532 and pod["serviceAccountName"] == "wp-warmpool-activator"
    (container,) = pod["containers"]
    assert container["command"] == ["warmpool", "activator"]
    assert {"--namespace=warmpool-system", f"--port={DEFAULT_ACTIVATOR_PORT}", "--health-port=8081",
            "--metrics-port=9090", "--drain-seconds=20"} <= set(container["args"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["terminationGracePeriodSeconds"] > 20
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    # Its Service carries the component label, which the EndpointSlice controller copies to the
    # slices the operator watches; the port is named as a pool Service's.
    service = _activator(objs, "Service")
    assert service["metadata"]["labels"][LABEL_COMPONENT] == COMPONENT_ACTIVATOR
    assert service["spec"]["selector"] == labels and service["spec"]["ports"][0]["name"] == WORKER_PORT_NAME
    assert _activator(objs, "PodDisruptionBudget")["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}
    role = _activator(objs, "Role")
    assert {(g, r): v for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in [tuple(rule["verbs"])]} == {
        (API_GROUP, "warmmodels"): ("get", "list", "watch", "patch"), ("", "services"): ("get", "list", "watch"),
        ("discovery.k8s.io", "endpointslices"): ("get", "list", "watch"),
        ("networking.k8s.io", "networkpolicies"): ("get", "list", "watch")}
    # Who is calling: pods, their namespaces and the nodes, read (never written) cluster-wide.
    callers = _activator_callers(objs)
    assert callers["rules"] == [{"apiGroups": [""], "resources": ["pods", "namespaces", "nodes"],
                                 "verbs": ["get", "list", "watch"]}]
    (binding,) = [b for b in by_kind(objs, "ClusterRoleBinding")
                  if b["metadata"]["name"] == "wp-warmpool-activator-callers"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "wp-warmpool-activator",
                                    "namespace": "warmpool-system"}]
    # The bounds that keep one client from exhausting it, from the values.
    bounds = {"--max-connections=1000", "--max-held-bytes=67108864", "--header-timeout=10", "--body-timeout=30"}
    assert bounds <= set(container["args"])
    operator_args = _operator_args(tmp_path)
    assert "--activator-service=warmpool-system/wp-warmpool-activator" in operator_args
    # The operator keeps the pools' slices: the one rule with delete.
    (slices,) = [r for r in _not_leader(objs, "Role")[0]["rules"] if "endpointslices" in r["resources"]]
    assert "delete" in slices["verbs"]

    # Off: no activator object, no flag.
    off = objects(render(tmp_path, {"activator": {"enabled": False}}))
    assert not [o for o in off if o["metadata"]["name"].startswith("wp-warmpool-activator")]
    assert not [a for a in _operator_args(tmp_path, {"activator": {"enabled": False}}) if "activator" in a]


def test_the_activators_values_reach_its_pods(tmp_path: Path) -> None:
    pod = _activator(objects(render(tmp_path, {})), "Deployment")["spec"]["template"]["spec"]
    # By default the replicas prefer different nodes: one node lost keeps a replica holding requests.
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"][LABEL_COMPONENT] == COMPONENT_ACTIVATOR
    (container,) = pod["containers"]
    assert container["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    assert "--log-level=INFO" in container["args"]
    assert not {"nodeSelector", "tolerations"} & set(pod)

    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}}
    tolerations = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    otel = {"name": ENV_OTEL_ENDPOINT, "value": "http://collector.observability:4318"}
    values = {"activator": {"replicas": 3, "port": 9000, "drainSeconds": 45, "logLevel": "DEBUG",
                            "extraEnv": [otel],
                            "nodeSelector": {"kubernetes.io/os": "linux"}, "tolerations": tolerations,
                            "affinity": affinity, "resources": {"requests": {"cpu": "1"}}}}
    objs = objects(render(tmp_path, values))
    deployment = _activator(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert pod["affinity"] == affinity and pod["tolerations"] == tolerations
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    (container,) = pod["containers"]
    # Helm merges a map value into the default: the other requests and the limit stay.
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    assert {"--port=9000", "--drain-seconds=45", "--log-level=DEBUG"} <= set(container["args"])
    # Its own variables stay, the extra ones follow (tracing: a trace per held request).
    assert [e["name"] for e in container["env"]][-1:] == [ENV_OTEL_ENDPOINT] and otel in container["env"]
    assert {"POD_NAME", "POD_IP"} <= {e["name"] for e in container["env"]}
    assert pod["terminationGracePeriodSeconds"] > 45
    assert _activator(objs, "Service")["spec"]["ports"][0]["port"] == 9000


def test_the_activators_network_policy_and_its_peer_on_the_workers(tmp_path: Path) -> None:
    objs = objects(render(tmp_path, {"watch": {"namespaces": ["team-a"]}}))
    policies = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in by_kind(objs, "NetworkPolicy")}
    activator = policies[("warmpool-system", "wp-warmpool-activator")]
    assert _ingress_ports(activator) == [[WORKER_PORT_NAME], [9090], [8081]]
    # workerClients' default ("pods of the worker's namespace") becomes the watched namespaces here.
    assert activator["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}}]
    peers = policies[("team-a", "wp-warmpool-workers")]["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "warmpool-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "warmpool", "app.kubernetes.io/instance": "wp",
                                            LABEL_COMPONENT: COMPONENT_ACTIVATOR}}} in peers
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    narrowed = objects(render(tmp_path, {"networkPolicy": {"workerClients": clients}}))
    (activator,) = [o for o in by_kind(narrowed, "NetworkPolicy") if o["metadata"]["name"] == "wp-warmpool-activator"]
    assert activator["spec"]["ingress"][0]["from"] == clients


def test_the_activator_may_change_only_its_own_held_annotation(tmp_path: Path) -> None:
    objs = objects(render(tmp_path, {}))
    (policy,) = [o for o in by_kind(objs, "ValidatingAdmissionPolicy")
                 if o["metadata"]["name"] == "wp-warmpool-activator-held-annotations"]
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:warmpool-system:wp-warmpool-activator'")
    own = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "own")
    assert f"'{HELD_ANNOTATION_PREFIX}'" in own and "authentication.kubernetes.io/pod-name" in own
    assert [o for o in by_kind(objs, "ValidatingAdmissionPolicyBinding")
            if o["spec"]["policyName"] == policy["metadata"]["name"]]


def _policy(objs: Sequence[Obj], name: str) -> Obj:
    (policy,) = [o for o in by_kind(objs, "ValidatingAdmissionPolicy") if o["metadata"]["name"] == name]
    return policy


def _variable(policy: Obj, name: str) -> str:
    return str(next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == name))


def test_the_operators_endpointslices_are_its_own_by_the_contracts_names(tmp_path: Path) -> None:
    """The EndpointSlice rules name warmpool/contract/zero.py's labels, manager and suffixes; every
    write and delete of the operator is matched; the Service check takes every Service of the
    slice's namespace as its parameters."""
    objs = objects(render(tmp_path, {}))
    shape = _policy(objs, "wp-warmpool-operator-endpointslices")
    assert shape["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["discovery.k8s.io"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["endpointslices"]}]
    assert shape["spec"]["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:warmpool-system:wp-warmpool'")
    for which in ("object", "oldObject"):
        ours = _variable(shape, "newOurs" if which == "object" else "oldOurs")
        for fact in (f"'{LABEL_ENDPOINTSLICE_MANAGED_BY}' in {which}.metadata.labels",
                     f"== '{ENDPOINTSLICE_MANAGER}'", f"'{LABEL_SERVICE_NAME}' in {which}.metadata.labels",
                     f"+ '{PODS_SLICE_SUFFIX}'", f"+ '{ACTIVATOR_SLICE_SUFFIX}'",
                     f"size({which}.metadata.ownerReferences) == 1", f"r.kind == '{KIND}'",
                     f"r.apiVersion.startsWith('{API_GROUP}/')"):
            assert fact in ours, (which, fact, ours)
    services = _policy(objs, "wp-warmpool-operator-endpointslice-services")
    assert services["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "Service"}
    assert f"'{LABEL_SERVICE_NAME}'" in _variable(services, "service")
    (binding,) = [b for b in by_kind(objs, "ValidatingAdmissionPolicyBinding")
                  if b["spec"]["policyName"] == "wp-warmpool-operator-endpointslice-services"]
    assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}


def test_no_service_account_of_the_chart_may_change_owner_references(tmp_path: Path) -> None:
    """The owner-reference rule covers every kind and subresource, for exactly the service accounts
    the release has."""
    def writers(values: Obj) -> str:
        policy = _policy(objects(render(tmp_path, values)), "wp-warmpool-owner-references")
        assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
            "apiGroups": ["*"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"], "resources": ["*/*"]}]
        return str(policy["spec"]["matchConditions"][0]["expression"])

    prefix = "system:serviceaccount:warmpool-system:wp-warmpool"
    assert writers({"nodeAgent": {"enabled": True}}) == (
        f"request.userInfo.username in ['{prefix}', '{prefix}-node-agent', '{prefix}-activator']")
    assert writers({"activator": {"enabled": False}}) == f"request.userInfo.username in ['{prefix}']"


def test_the_operator_only_patches_the_status_it_never_reads_there(tmp_path: Path) -> None:
    """Its status writes and kopf's are merge patches of the subresource: no verb beside patch."""
    (role,) = [r for r in by_kind(objects(render(tmp_path, VALUE_SETS["cluster-wide, everything on"])), "ClusterRole")
               if r["metadata"]["name"] == "wp-warmpool"]
    assert [r["verbs"] for r in role["rules"] if r["resources"] == ["warmmodels/status"]] == [["patch"]]


def test_the_activators_held_value_bounds_are_the_contracts(tmp_path: Path) -> None:
    """The count bound and clock skew the policy enforces are the ones the operator checks again."""
    policy = _policy(objects(render(tmp_path, {})), "wp-warmpool-activator-held-annotations")
    assert int(_variable(policy, "maxHeldCount")) == HELD_COUNT_MAX
    assert int(_variable(policy, "clockSkewSeconds")) == HELD_CLOCK_SKEW_SECONDS
    assert f"{{1,{len(str(HELD_COUNT_MAX))}}}" in _variable(policy, "wellFormed")
    assert f"{{1,{len(str(MAX_UNIX_SECONDS))}}}" in _variable(policy, "wellFormed")


# --------------------------------------------------------------------------- conventions users expect


def _pod(objs: Sequence[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
    pod: Obj = found["spec"]["template"]
    return pod


#: The three workloads of a release with the node agent on: (kind, name, the values key of its settings).
COMPONENTS = (("Deployment", "wp-warmpool", "operator"), ("Deployment", "wp-warmpool-activator", "activator"),
              ("DaemonSet", "wp-warmpool-node-agent", "nodeAgent"))


def test_the_chart_names_the_kubernetes_it_needs(tmp_path: Path) -> None:
    """Chart.yaml's kubeVersion: ValidatingAdmissionPolicy v1 (on by default) is GA from 1.30, so an
    older cluster is refused with helm's message before anything is made; providers' versions pass."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    policies = [o for o in objects(render(tmp_path, {})) if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert policies and {o["apiVersion"] for o in policies} == {"admissionregistration.k8s.io/v1"}
    old = helm("template", "wp", str(CHART), "--kube-version", "v1.29.9", check=False)
    assert old.returncode != 0 and "chart requires kubeVersion: >=1.30.0-0" in old.stderr, old.stderr
    for version in ("v1.30.0", "v1.30.4-eks-a737599", "v1.31.1-gke.1146000", KUBE_VERSION):
        helm("template", "wp", str(CHART), "--kube-version", version, *render_only_set_flags())


def test_log_format_and_extra_args_reach_every_component(tmp_path: Path) -> None:
    """logFormat and extraArgs of each component are flags its own parser takes, the extra ones
    last (so one given twice overrides the chart's); by default text and nothing extra."""
    from warmpool_nodecache.agent_cli import build_parser as agent_parser
    from warmpool_operator.activator.app import build_parser as activator_parser
    from warmpool_operator.app.cli import build_parser as operator_parser

    parsers = {"operator": operator_parser, "activator": activator_parser, "nodeAgent": agent_parser}
    on = {"nodeAgent": {"enabled": True}}
    defaults = objects(render(tmp_path, on))
    for kind, name, key in COMPONENTS:
        (container,) = _pod(defaults, kind, name)["spec"]["containers"]
        parsed = parsers[key]().parse_args(container["args"])
        assert parsed.log_format == "text", name
        assert "--log-format=text" in container["args"]
    extra = {"operator": ["--api-concurrency=32"], "activator": ["--max-connections", "5"],
             "nodeAgent": ["--partial-view", "--manifest-reads=2"]}
    values: dict[str, Obj] = {key: {"logFormat": "json", "extraArgs": extra[key]} for key in parsers}
    values["nodeAgent"]["enabled"] = True
    manifest = render(tmp_path, values)
    objs = objects(manifest)
    for kind, name, key in COMPONENTS:
        (container,) = _pod(objs, kind, name)["spec"]["containers"]
        assert container["args"][-len(extra[key]):] == extra[key], name
        parsed = parsers[key]().parse_args(container["args"])
        assert parsed.log_format == "json", name
    assert operator_parser().parse_args(_pod(objs, *COMPONENTS[0][:2])["spec"]["containers"][0]["args"]
                                        ).api_concurrency == 32
    assert activator_parser().parse_args(_pod(objs, *COMPONENTS[1][:2])["spec"]["containers"][0]["args"]
                                         ).max_connections == 5
    agent = agent_parser().parse_args(_pod(objs, *COMPONENTS[2][:2])["spec"]["containers"][0]["args"])
    assert agent.partial_view is True and agent.manifest_reads == 2
    # The README's pointer for the flags extraArgs may add: each command's --help lists them.
    for command in ("operator", "activator", "node-agent"):
        shown = subprocess.run([sys.executable, "-m", "warmpool", command, "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
        assert "--log-format" in shown and "--log-level" in shown, command


def test_pod_annotations_labels_and_priority_of_every_component(schema_dir: Path, tmp_path: Path) -> None:
    """podAnnotations, podLabels and priorityClassName for each component, and the node agent's
    affinity; the labels never enter a selector (immutable in a Deployment or DaemonSet)."""
    defaults = objects(render(tmp_path, {"nodeAgent": {"enabled": True}}))
    for kind, name, _ in COMPONENTS:
        pod = _pod(defaults, kind, name)
        assert "annotations" not in pod["metadata"] and "priorityClassName" not in pod["spec"], name
    assert "affinity" not in _pod(defaults, "DaemonSet", "wp-warmpool-node-agent")["spec"]

    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]}}}
    per = {key: {"podAnnotations": {"example.com/owner": key}, "podLabels": {"team": key.lower()},
                 "priorityClassName": f"{key.lower()}-critical"} for key in ("activator", "nodeAgent")}
    values: Obj = {**per, "podAnnotations": {"example.com/owner": "operator"}, "podLabels": {"team": "operator"},
                   "priorityClassName": "operator-critical"}
    values["nodeAgent"] |= {"enabled": True, "affinity": affinity}
    manifest = render(tmp_path, values)
    assert_valid(schema_dir, manifest)
    objs = objects(manifest)
    for kind, name, key in COMPONENTS:
        (workload,) = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
        pod = workload["spec"]["template"]
        assert pod["metadata"]["annotations"] == {"example.com/owner": key}, name
        assert pod["metadata"]["labels"]["team"] == key.lower(), name
        assert "team" not in workload["spec"]["selector"]["matchLabels"], name
        assert pod["spec"]["priorityClassName"] == f"{key.lower()}-critical", name
    assert _pod(objs, "DaemonSet", "wp-warmpool-node-agent")["spec"]["affinity"] == affinity


def test_the_node_agents_service_account_takes_a_cloud_identity(schema_dir: Path, tmp_path: Path) -> None:
    """IRSA and the like: the agent's ServiceAccount carries the annotations boto3's default chain needs."""
    def account(objs: list[Obj]) -> Obj:
        (found,) = [o for o in by_kind(objs, "ServiceAccount") if o["metadata"]["name"] == "wp-warmpool-node-agent"]
        return found

    assert "annotations" not in account(objects(render(tmp_path, {"nodeAgent": {"enabled": True}})))["metadata"]
    role = {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/warmpool-models"}
    manifest = render(tmp_path, {"nodeAgent": {"enabled": True, "serviceAccountAnnotations": role}})
    assert_valid(schema_dir, manifest)
    assert account(objects(manifest))["metadata"]["annotations"] == role


#: What each component's pod and container ran as before the values existed: the defaults stay.
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
AGENT_CONTAINER = {"runAsUser": 0, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                   "capabilities": {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]},
                   "seccompProfile": {"type": "RuntimeDefault"}}


def _readme_block(heading: str) -> str:
    """The first ```yaml block after ``heading`` in the chart's README (the doc a test runs)."""
    text = (CHART / "README.md").read_text()
    match = re.search(re.escape(heading) + r".*?```yaml\n(.*?)```", text, re.S)
    assert match, f"README has no yaml block under {heading!r}"
    return match.group(1)


def test_security_contexts_keep_their_defaults_and_can_be_overridden(schema_dir: Path, tmp_path: Path) -> None:
    """Pod and container security contexts per component: unchanged by default; a key set to null
    is left out (OpenShift's restricted SCC picks the UID from the namespace's range, and refuses
    a pod that names 65532); a key set is used."""
    defaults = objects(render(tmp_path, {"nodeAgent": {"enabled": True}}))
    for name in ("wp-warmpool", "wp-warmpool-activator"):
        spec = _pod(defaults, "Deployment", name)["spec"]
        assert spec["securityContext"] == RESTRICTED_POD, name
        assert spec["containers"][0]["securityContext"] == RESTRICTED_CONTAINER, name
    agent = _pod(defaults, "DaemonSet", "wp-warmpool-node-agent")["spec"]
    assert "securityContext" not in agent and agent["containers"][0]["securityContext"] == AGENT_CONTAINER

    # The README's OpenShift values, as written there.
    openshift = yaml.safe_load(_readme_block("### OpenShift"))
    manifest = render(tmp_path, openshift)
    assert_valid(schema_dir, manifest)
    objs = objects(manifest)
    for name in ("wp-warmpool", "wp-warmpool-activator"):
        spec = _pod(objs, "Deployment", name)["spec"]
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}, name
        assert spec["containers"][0]["securityContext"] == RESTRICTED_CONTAINER, name
        _assert_restricted(spec)

    # Set instead: a UID of the namespace's range, an SELinux level; the other keys stay.
    values = {"activator": {"podSecurityContext": {"runAsUser": 1000680000, "seLinuxOptions": {"level": "s0:c26,c5"}},
                            "securityContext": {"runAsUser": 1000680000}},
              "nodeAgent": {"enabled": True, "securityContext": {"seLinuxOptions": {"type": "spc_t"}}}}
    manifest = render(tmp_path, values)
    assert_valid(schema_dir, manifest)
    objs = objects(manifest)
    activator = _pod(objs, "Deployment", "wp-warmpool-activator")["spec"]
    assert activator["securityContext"] == RESTRICTED_POD | {"runAsUser": 1000680000,
                                                             "seLinuxOptions": {"level": "s0:c26,c5"}}
    assert activator["containers"][0]["securityContext"] == RESTRICTED_CONTAINER | {"runAsUser": 1000680000}
    assert _pod(objs, "DaemonSet", "wp-warmpool-node-agent")["spec"]["containers"][0]["securityContext"] == (
        AGENT_CONTAINER | {"seLinuxOptions": {"type": "spc_t"}})
    assert _pod(objs, "Deployment", "wp-warmpool")["spec"]["securityContext"] == RESTRICTED_POD


def _pdbs(objs: Sequence[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o["spec"] for o in by_kind(objs, "PodDisruptionBudget")}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_single_replica_gets_no_pdb_that_would_block_a_drain(replicas: int, tmp_path: Path) -> None:
    """The operator and the activator alike: with several replicas a PDB lets one go at a time;
    with one, none (a PDB keeping a single replica refuses every eviction: no drain of its node
    could finish)."""
    objs = objects(render(tmp_path, {"operator": {"replicas": replicas}, "activator": {"replicas": replicas}}))
    pdbs = _pdbs(objs)
    for name in ("wp-warmpool", "wp-warmpool-activator"):
        if replicas == 1:
            assert name not in pdbs, pdbs
            continue
        selector = next(d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == name)["spec"]["selector"]
        assert pdbs[name] == {"maxUnavailable": 1, "selector": selector}, name


#: Who may do what to WarmModels through the built-in roles, once the chart's roles are aggregated.
ROLE_VERBS = {
    "view": {("warmmodels", "get"), ("warmmodels", "list"), ("warmmodels", "watch"),
             ("warmmodels/status", "get"), ("warmmodels/scale", "get")},
    "edit": {("warmmodels", "create"), ("warmmodels", "update"), ("warmmodels", "patch"), ("warmmodels", "delete"),
             ("warmmodels", "deletecollection"), ("warmmodels/scale", "update"), ("warmmodels/scale", "patch")},
}


def _grants(role: Obj) -> set[tuple[str, str]]:
    return {(r, v) for rule in role["rules"] if rule["apiGroups"] == [API_GROUP]
            for r in rule["resources"] for v in rule["verbs"]}


def test_aggregated_roles_give_view_read_and_edit_write_never_status(tmp_path: Path) -> None:
    roles = {o["metadata"]["name"]: o for o in by_kind(objects(render(tmp_path, {})), "ClusterRole") if _aggregated(o)}
    assert set(roles) == {"wp-warmpool-view", "wp-warmpool-edit"}
    view, edit = roles["wp-warmpool-view"], roles["wp-warmpool-edit"]
    assert {AGGREGATE_TO[k] for k, v in view["metadata"]["labels"].items() if k in AGGREGATE_TO and v == "true"} == {
        "view", "edit", "admin"}
    assert {AGGREGATE_TO[k] for k, v in edit["metadata"]["labels"].items() if k in AGGREGATE_TO and v == "true"} == {
        "edit", "admin"}
    assert _grants(view) >= {g for g in ROLE_VERBS["view"]} and all(v in ("get", "list", "watch")
                                                                      for _, v in _grants(view))
    assert _grants(edit) == ROLE_VERBS["edit"]
    assert not [g for g in _grants(edit) if g[0] == "warmmodels/status"]
    for rule in view["rules"] + edit["rules"]:
        assert rule["apiGroups"] == [API_GROUP] and "*" not in rule["verbs"], rule
    for off in ({"rbac": {"aggregateToDefaultRoles": False}}, {"rbac": {"create": False}}):
        assert not [o for o in objects(render(tmp_path, off)) if _aggregated(o)], off


def _can(api: ClusterHandle, user: str, verb: str, resource: str, namespace: str) -> bool:
    plural, _, subresource = resource.partition("/")
    which = ["--subresource", subresource] if subresource else []
    proc = api.kubectl("auth", "can-i", verb, f"{plural}.{API_GROUP}", *which, "-n", namespace, "--as", user,
                       check=False)
    assert proc.stdout.strip() in ("yes", "no"), (proc.stdout, proc.stderr)
    return proc.stdout.strip() == "yes"


def test_the_built_in_roles_reach_warmmodels_on_a_real_api_server(api_server: ClusterHandle, tmp_path: Path) -> None:
    """The rendered ClusterRoles on a real API server, aggregated by kube-controller-manager's own
    controller: a user bound to the built-in view may get, list and watch WarmModels and nothing
    more, one bound to edit or admin may also create, change, scale and delete them; no one may
    write their status.  Before the chart's roles, view could not read them at all."""
    from tests.support.controller_manager import controllers

    namespace = f"agg-{uuid.uuid4().hex[:6]}"
    release = f"agg{uuid.uuid4().hex[:6]}"
    users = {role: f"{role}-{namespace}" for role in ("view", "edit", "admin")}
    api_server.kubectl("create", "namespace", namespace)
    rendered = [o for o in objects(render(tmp_path, {})) if o["kind"] == "ClusterRole" and _aggregated(o)]
    assert rendered, "the chart renders no aggregated ClusterRole"
    for obj in rendered:
        obj["metadata"]["name"] = obj["metadata"]["name"].replace("wp-warmpool", f"{release}-warmpool")
    try:
        for role, user in users.items():
            api_server.kubectl("create", "rolebinding", f"{role}-user", f"--clusterrole={role}", f"--user={user}",
                               "-n", namespace)
        with controllers(api_server, ["clusterrole-aggregation-controller"], tmp_path / "controller-manager.log"):
            # The negative control: the built-in roles alone give nothing on WarmModels.  On an API server
            # kept from an earlier run they may still hold an earlier release's rules, until the
            # controller's first sync takes them out: waited for, within a bound.
            deadline = time.monotonic() + 60
            while (_can(api_server, users["view"], "get", "warmmodels", namespace)
                   or _can(api_server, users["edit"], "create", "warmmodels", namespace)):
                assert time.monotonic() < deadline, "the built-in roles give WarmModels without the chart's roles"
                time.sleep(0.5)
            api_server.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rendered))
            deadline = time.monotonic() + 60
            while not (_can(api_server, users["view"], "list", "warmmodels", namespace)
                       and _can(api_server, users["admin"], "delete", "warmmodels", namespace)):
                assert time.monotonic() < deadline, "the chart's roles were never aggregated"
                time.sleep(0.5)
        for role, user in users.items():
            granted = ROLE_VERBS["view"] | (ROLE_VERBS["edit"] if role != "view" else set())
            for resource, verb in sorted(ROLE_VERBS["view"] | ROLE_VERBS["edit"]):
                assert _can(api_server, user, verb, resource, namespace) == ((resource, verb) in granted), (
                    role, verb, resource)
            for verb in ("update", "patch"):
                assert not _can(api_server, user, verb, "warmmodels/status", namespace), (role, verb)
        # The grants are per namespace: a binding in one namespace reaches no other.
        assert not _can(api_server, users["edit"], "create", "warmmodels", "default")
    finally:
        for obj in rendered:
            api_server.kubectl("delete", "clusterrole", obj["metadata"]["name"], "--ignore-not-found", check=False)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)


# --------------------------------------------------------------------------- bad values

BAD_VALUES: dict[str, tuple[Obj, str]] = {
    "typo at the top": ({"imgae": {"tag": "x"}}, "imgae"),
    "typo nested": ({"operator": {"scrapeIntervall": 5}}, "scrapeIntervall"),
    "typo two levels down": ({"probes": {"liveness": {"periodSecond": 5}}}, "periodSecond"),
    "wrong type": ({"operator": {"scrapeInterval": "fast"}}, "want number"),
    "wrong type bool": ({"watch": {"allNamespaces": "yes"}}, "want boolean"),
    "not in enum": ({"operator": {"logLevel": "VERBOSE"}}, "logLevel"),
    "bad namespace name": ({"watch": {"namespaces": ["Team_A"]}}, "namespaces"),
    "port out of range": ({"operator": {"metricsPort": 70000}}, "metricsPort"),
    "bad digest": ({"image": {"digest": "latest"}}, "digest"),
    "relative host path": ({"operator": {"allowedHostPaths": ["models"]}}, "allowedHostPaths"),
    "no host path at all": ({"operator": {"allowedHostPaths": []}}, "allowedHostPaths"),
    "node agent typo": ({"nodeAgent": {"enabeld": True}}, "enabeld"),
    "node agent relative cache root": ({"nodeAgent": {"cacheRoot": "cache"}}, "cacheRoot"),
    "node agent negative budget": ({"nodeAgent": {"budgetBytes": -1}}, "budgetBytes"),
    "network policy peer typo": ({"networkPolicy": {"workerClients": [{"podSelecter": {}}]}}, "podSelecter"),
    "network policy bad namespace": ({"networkPolicy": {"workerNamespaces": ["Models"]}}, "workerNamespaces"),
    "activator typo": ({"activator": {"replica": 2}}, "replica"),
    "activator no replicas": ({"activator": {"replicas": 0}}, "replicas"),
    "operator log format": ({"operator": {"logFormat": "logfmt"}}, "logFormat"),
    "activator log format": ({"activator": {"logFormat": "JSON"}}, "logFormat"),
    "node agent log format": ({"nodeAgent": {"logFormat": "yaml"}}, "logFormat"),
    "extra args not a list": ({"operator": {"extraArgs": "--api-concurrency=32"}}, "extraArgs"),
    "extra arg empty": ({"activator": {"extraArgs": [""]}}, "extraArgs"),
    "extra arg a number": ({"nodeAgent": {"extraArgs": [2]}}, "extraArgs"),
    "pod annotation not a string": ({"activator": {"podAnnotations": {"a": 1}}}, "podAnnotations"),
    "pod label not a string": ({"nodeAgent": {"podLabels": {"team": True}}}, "podLabels"),
    "priority class not a string": ({"nodeAgent": {"priorityClassName": 1000}}, "priorityClassName"),
    "node agent affinity typo": ({"nodeAgent": {"affinity": {"nodeAfinity": {}}}}, "nodeAfinity"),
    "pod security context typo": ({"podSecurityContext": {"runAsUsr": 1000}}, "runAsUsr"),
    "pod security context negative uid": ({"activator": {"podSecurityContext": {"runAsUser": -1}}}, "runAsUser"),
    "container security context typo": ({"nodeAgent": {"securityContext": {"privilegd": True}}}, "privilegd"),
    "seccomp type": ({"securityContext": {"seccompProfile": {"type": "Default"}}}, "type"),
    "capability lower case": ({"activator": {"securityContext": {"capabilities": {"add": ["net_admin"]}}}},
                              "capabilities"),
    "aggregated roles not a bool": ({"rbac": {"aggregateToDefaultRoles": "yes"}}, "aggregateToDefaultRoles"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_values_fail_with_the_schemas_message(name: str, tmp_path: Path) -> None:
    values, needle = BAD_VALUES[name]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm("template", "wp", str(CHART), "-f", str(path), check=False)
    assert proc.returncode != 0, proc.stdout[:500]
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert needle in proc.stderr, proc.stderr


def test_servicemonitor_needs_the_service(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(render_only_values(
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}})))
    proc = helm("template", "wp", str(CHART), "-f", str(path), check=False)
    assert proc.returncode != 0 and "metrics.service.enabled" in proc.stderr


# --------------------------------------------------------------------------- conventions


def _schema_keys(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key, sub in (schema.get("properties") or {}).items():
        yield prefix + key, sub
        yield from _schema_keys(sub, f"{prefix}{key}.")


def test_values_schema_refuses_unknown_keys_at_every_level() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: Mapping[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where or '<root>'} accepts unknown keys"
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{where}.{key}".lstrip("."))
        items = node.get("items")
        if isinstance(items, dict):
            walk(items, f"{where}[]")

    walk(schema, "")
    # The Kubernetes objects values share ($ref: the security contexts), as strict.
    assert schema["definitions"]
    for name, definition in schema["definitions"].items():
        walk(definition, f"definitions.{name}")


def test_every_value_is_commented_and_in_the_schema() -> None:
    """Each key of values.yaml the schema declares has a comment above it; none is undeclared."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    declared = {key for key, _ in _schema_keys(schema)}
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    seen: set[str] = set()
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z0-9_.\-/]+):(\s|$)", line)
        if not match or line.lstrip().startswith("#"):
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), match.group(2)])
        stack.append((indent, match.group(2)))
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent and parent not in declared:
            continue
        if parent in declared and path not in declared:
            # A free-form map's entries (resources.requests.cpu, dashboard.labels.*) are data.
            parent_schema = dict(_schema_keys(schema))[parent]
            assert "properties" not in parent_schema, f"values.yaml: {path} is not in values.schema.json"
            continue
        assert path in declared, f"values.yaml: {path} is not in values.schema.json"
        assert lines[i - 1].strip().startswith("#"), f"values.yaml line {i + 1}: {path} has no comment"
        seen.add(path)
    # Left out of values.yaml: Helm's `global`, and the optional fields of a value whose
    # default is empty (affinity: {} has nodeAffinity, podAffinity, ...).
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in declared - seen - {"global"}:
        node: Any = defaults
        for part in path.split(".")[:-1]:
            node = node[part]
        assert node == {}, f"schema key {path} is missing from values.yaml"


# --------------------------------------------------------------------------- runbooks

RUNBOOKS = REPO / "docs" / "runbooks"


def test_runbooks_use_real_names() -> None:
    """Metric names, condition reasons and annotations in the runbooks are the code's own."""
    names = {v for v in contract_values().values() if isinstance(v, str)}
    # The condition reasons: the core conditions' (status) and the Forecast condition's own.
    reasons = {v for module in (status, forecast_report) for k, v in vars(module).items()
               if k.startswith("REASON_") and isinstance(v, str)}
    pages = {p.name: p.read_text() for p in RUNBOOKS.glob("*.md")}
    assert {"pool-not-warming.md", "tier-stuck-paused.md", "weights-corrupt-or-missing.md", "operator-down.md",
            "scaling.md", "upgrading.md"} <= set(pages)
    for page, text in pages.items():
        for metric in re.findall(r"(?<![/\w])warmpool_[a-z_]+", text):
            if metric.endswith("_"):  # a prefix in a grep pattern
                continue
            base = re.sub(r"_(bucket|count|sum)$", "", metric)
            assert base in names, f"{page}: metric {metric} is not in warmpool/contract/"
        for annotation in re.findall(r"\bwarmpool\.dev/[a-z-]+(?![0-9a-z-])", text):
            assert annotation in names, f"{page}: {annotation} is not a name from warmpool/contract/"
    # The reasons table covers every reason the operator writes, and nothing else.
    table = pages["README.md"][pages["README.md"].index("| `Ready` |"):]
    mentioned = set(re.findall(r"`([A-Z][A-Za-z]+)`", table)) - set(CONDITION_TYPES)
    assert mentioned == reasons, (mentioned - reasons, reasons - mentioned)
    for page, text in pages.items():
        for word in re.findall(r"reason `([A-Z][A-Za-z]+)`", text):
            assert word in reasons, f"{page}: reason {word} is not one the operator writes"
    # The events reason the operator posts on tier transitions.
    assert 'reason="TierChanged"' in (REPO / "operator" / "warmpool_operator" / "control" / "tiers.py").read_text()
