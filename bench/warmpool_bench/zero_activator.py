"""The activator as the chart runs it (two PSS-restricted replicas of the operator's image, a
Service labelled as the activator's, a ServiceAccount and what it may read and patch), in one
namespace of the local cluster: for `warmpool bench zero` and the real-node test of scale to zero
(tests/e2e/test_e2e_zero.py), which run the operator as a local process rather than by the chart."""

from __future__ import annotations

from typing import Any

from warmpool.contract.api import API_GROUP, PLURAL
from warmpool.contract.pods import LABEL_COMPONENT
from warmpool.contract.zero import COMPONENT_ACTIVATOR, DEFAULT_ACTIVATOR_PORT

NAME = "activator"
LABELS = {"app": "warmpool-activator-local", LABEL_COMPONENT: COMPONENT_ACTIVATOR}
SELECTOR = f"app={LABELS['app']}"
HEALTH_PORT = 8081
METRICS_PORT = 9090
REPLICAS = 2
#: The cluster-wide read of callers (pods, namespaces, nodes) the activator needs, shared by namespaces.
CALLERS_ROLE = "warmpool-activator-local-callers"


def activator_objects(image: str, namespace: str, drain_seconds: float = 5.0) -> list[dict[str, Any]]:
    meta = {"name": NAME, "labels": LABELS}
    container = {
        "name": NAME, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["warmpool", "activator", "--namespace", namespace, "--bind", "$(POD_IP)",
                    "--port", str(DEFAULT_ACTIVATOR_PORT), "--health-port", str(HEALTH_PORT),
                    "--metrics-port", str(METRICS_PORT), "--drain-seconds", f"{drain_seconds:g}"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": DEFAULT_ACTIVATOR_PORT}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": HEALTH_PORT}, "periodSeconds": 1},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": HEALTH_PORT}, "periodSeconds": 10},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
            {"apiGroups": [API_GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]},
        ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}]},
        # Who is calling: pods, namespaces and nodes, read cluster-wide (one role, a binding per namespace).
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": CALLERS_ROLE},
         "rules": [{"apiGroups": [""], "resources": ["pods", "namespaces", "nodes"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{CALLERS_ROLE}-{namespace}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CALLERS_ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": REPLICAS, "selector": {"matchLabels": LABELS},
            "template": {"metadata": {"labels": LABELS}, "spec": {
                "serviceAccountName": NAME, "enableServiceLinks": False,
                "terminationGracePeriodSeconds": int(drain_seconds) + 5,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
            "selector": LABELS, "ports": [{"name": "http", "port": DEFAULT_ACTIVATOR_PORT, "targetPort": "http"}]}},
    ]
