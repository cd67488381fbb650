"""The operator's hardening (issue #12) on the real local control plane, with real worker processes.

Each test runs its own `python -m warmpool operator` subprocess against the session's cluster,
makes a real fault (an object of someone else holding a child's name, a pod that only carries
our labels, metrics that cannot be reached, a hand edit, an admission policy that refuses the
Deployment, an operator restart) and watches what the operator does.  Every wait is bounded.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, warmmodel
from warmpool.contract.api import CONDITION_DEGRADED, CONDITION_READY, PLURAL
from warmpool.contract.files import CONFIGMAP_KEY_HEATMAP
from warmpool.contract.http import CONTROL_TOKEN_HEADER, DEFAULT_WORKER_PORT
from warmpool.contract.metrics import (
    LABEL_TARGET,
    LABEL_TIER,
    METRIC_MEMORY_USED_RATIO,
    METRIC_OPERATOR_WRITE_FAILURES,
    METRIC_READY,
    METRIC_TIER,
)
from warmpool.contract.pods import (
    ANNOTATION_TIER,
    CONFIGMAP_SUFFIX,
    CONTROL_SECRET_KEY,
    CONTROL_SECRET_SUFFIX,
    WORKER_CONTAINER,
)

pytestmark = pytest.mark.integration

MakeWorld = Callable[..., World]


@pytest.fixture()
def make_world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[MakeWorld]:
    """A World whose operator subprocess takes the given Operator options (started once made)."""
    made: list[World] = []

    def make(**options: Any) -> World:
        operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False, **options)
        operator.start()
        world = World(cluster, namespace, operator, diagnose_timeouts=True)
        made.append(world)
        return world

    yield make
    for world in made:
        if not world.operator.running():
            world.operator.start()
        delete_warmmodels(cluster, namespace)
        world.operator.stop()
        world.close()


#: Memory measured against a capacity far above what a tiny worker uses: its tier stays full
#: whatever else runs on this machine, so a tier moves only when the operator moves it.
STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]


def small(name: str, model: Path, **pool: int) -> dict[str, Any]:
    return warmmodel(name, model, replicas=pool.get("replicas", 1), min_warm=pool.get("min_warm", 1),
                     max_replicas=pool.get("max_replicas", 3), worker_args=STEADY_MEMORY)


def owner_uids(obj: dict[str, Any]) -> list[str]:
    return [ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []]


def create(world: World, obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(world.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(obj)))
    return out


# --------------------------------------------------------------------------- item 1 (+ item 7: name freed)


def test_a_foreign_object_with_a_childs_name_is_never_taken_over(make_world: MakeWorld, tiny_model: Path) -> None:
    world = make_world()
    ns = world.ns
    team = {"team": "someone-else"}
    service = create(world, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "clash", "labels": team},
                             "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    configmap = create(world, {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": f"cmclash{CONFIGMAP_SUFFIX}", "labels": team},
                               "data": {"theirs": "keep me"}})
    secret = create(world, {"apiVersion": "v1", "kind": "Secret",
                            "metadata": {"name": f"secclash{CONTROL_SECRET_SUFFIX}", "labels": team},
                            "data": {CONTROL_SECRET_KEY: "dGhlaXJz"}})
    for name in ("clash", "cmclash", "secclash"):
        world.apply(small(name, tiny_model))

    def conflict(name: str) -> dict[str, Any] | None:
        cond = world.condition(name, CONDITION_DEGRADED)
        return cond if cond.get("status") == "True" and cond.get("reason") == "ChildConflict" else None

    assert f"Service {ns}/clash" in world.wait(lambda: conflict("clash"), 30, "clash Degraded ChildConflict")["message"]
    assert f"ConfigMap {ns}/cmclash" in world.wait(lambda: conflict("cmclash"), 30, "cmclash conflict")["message"]
    assert f"Secret {ns}/secclash" in world.wait(lambda: conflict("secclash"), 30, "secclash conflict")["message"]
    # The other children are made (a Deployment only where its pods would not mount someone else's object).
    world.wait(lambda: world.maybe("deployment", "clash"), 30, "clash's own Deployment")
    world.wait(lambda: world.maybe("service", "cmclash") and world.maybe("service", "secclash"), 30,
               "the Services of the WarmModels whose ConfigMap / Secret name is taken")
    assert world.maybe("deployment", "cmclash") is None and world.maybe("deployment", "secclash") is None

    time.sleep(3)  # a few operator passes: not one of them may write to the foreign objects
    for before, what in ((service, "service/clash"), (configmap, f"configmap/cmclash{CONFIGMAP_SUFFIX}"),
                         (secret, f"secret/secclash{CONTROL_SECRET_SUFFIX}")):
        now = world.get(*what.split("/"))
        assert now["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], what
        assert not owner_uids(now), f"{what} was adopted: {now['metadata'].get('ownerReferences')}"

    # Deleting the WarmModels leaves the foreign objects alone (no owner reference, so no garbage collection).
    def collected(uid: str) -> bool:
        return not any(uid in owner_uids(s) for s in world.get("services")["items"])

    for name in ("cmclash", "secclash"):
        uid = str(world.wm(name)["metadata"]["uid"])
        world.kubectl("delete", PLURAL, name, "--timeout=60s")
        world.wait(functools.partial(collected, uid), 60, f"{name}'s own children garbage-collected")
    assert world.get("configmap", f"cmclash{CONFIGMAP_SUFFIX}")["data"] == {"theirs": "keep me"}
    assert world.get("secret", f"secclash{CONTROL_SECRET_SUFFIX}")["data"] == secret["data"]

    # The name freed, the next pass makes our own Service and the WarmModel heals without a spec edit.
    world.kubectl("delete", "service", "clash")
    wm = world.wait_ready("clash", warm=1, timeout=120)
    assert world.condition("clash", CONDITION_DEGRADED)["status"] == "False"
    assert owner_uids(world.get("service", "clash")) == [wm["metadata"]["uid"]]


# --------------------------------------------------------------------------- item 4

IMPOSTOR = """
import http.server, json, os, sys
log = open(sys.argv[1], "a", buffering=1)
body = (sys.argv[2] + "\\n").encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self):
        log.write(json.dumps({"method": self.command, "path": self.path,
                              "auth": self.headers.get(sys.argv[3])}) + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
server = http.server.HTTPServer((os.environ["POD_IP"], int(sys.argv[4])), Handler)
open(sys.argv[1] + ".listening", "w").close()
server.serve_forever()
"""


def test_a_pod_that_only_carries_our_labels_is_never_scraped_nor_sent_the_token(
    make_world: MakeWorld, tiny_model: Path, tmp_path: Path
) -> None:
    world = make_world()
    world.apply(small("scraped", tiny_model))
    world.wait_ready("scraped", warm=1, timeout=120)
    template = world.get("deployment", "scraped")["spec"]["template"]
    # Plausible worker metrics: before the fix the operator decided a tier and POSTed it with the token.
    metrics_body = "\n".join([f"{METRIC_READY} 1", f'{METRIC_MEMORY_USED_RATIO}{{source="x"}} 0.1',
                              f'{METRIC_TIER}{{{LABEL_TIER}="full"}} 1'])
    script = tmp_path / "impostor.py"
    script.write_text(IMPOSTOR)
    requests = tmp_path / "impostor-requests.jsonl"
    requests.touch()
    # The worker's own image (already on the node, so nothing is pulled) runs the impostor; the
    # test's directory is mounted at the same path so that what it records is read here.
    world.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "impostor", "labels": template["metadata"]["labels"]},
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
            "name": WORKER_CONTAINER, "image": template["spec"]["containers"][0]["image"],
            "imagePullPolicy": "IfNotPresent", "securityContext": {"runAsUser": 0},
            "command": ["/opt/warmpool/bin/python", str(script), str(requests), metrics_body,
                        CONTROL_TOKEN_HEADER, str(DEFAULT_WORKER_PORT)],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [{"name": "work", "mountPath": str(tmp_path)}]}],
            "volumes": [{"name": "work", "hostPath": {"path": str(tmp_path), "type": "Directory"}}]}}))
    world.wait(lambda: Path(str(requests) + ".listening").exists(), 60, "the impostor listening on its pod IP")
    world.wait(lambda: world.get("pod", "impostor")["status"].get("phase") == "Running", 30, "impostor Running")

    time.sleep(5)  # five scrape intervals
    seen = [json.loads(line) for line in requests.read_text().splitlines()]
    assert seen == [], f"the operator talked to a pod that is not its own: {seen}"
    impostor = world.get("pod", "impostor")
    assert ANNOTATION_TIER not in (impostor["metadata"].get("annotations") or {})
    assert world.wm("scraped")["status"]["replicas"] == 1
    assert "not a pod of its Deployment" in world.operator.log()


# --------------------------------------------------------------------------- item 5


def test_unreadable_metrics_never_grow_the_pool(make_world: MakeWorld, tiny_model: Path) -> None:
    # The operator may dial 127.0.0.1 only; pods live in 127.N.0.0/16 (N >= 10): Ready by their
    # probes, yet their /metrics cannot be read (as behind a NetworkPolicy).
    world = make_world(scrape_network="127.0.0.1/32")
    world.apply(small("unread", tiny_model, replicas=1, min_warm=1, max_replicas=3))

    def unavailable() -> dict[str, Any] | None:
        cond = world.condition("unread", CONDITION_READY)
        return cond if cond.get("reason") == "MetricsUnavailable" else None

    cond = world.wait(unavailable, 120, "Ready=False MetricsUnavailable")
    pod = world.pods("unread")[0]
    assert cond["status"] == "False" and pod["metadata"]["name"] in cond["message"]
    replicas = []
    deadline = time.monotonic() + 8  # eight passes of the operator
    while time.monotonic() < deadline:
        replicas.append(world.get("deployment", "unread")["spec"]["replicas"])
        time.sleep(0.5)
    assert set(replicas) == {1}, f"the pool grew for pods whose metrics cannot be read: {replicas}"


# --------------------------------------------------------------------------- item 6


def test_hand_edits_of_children_are_undone(make_world: MakeWorld, tiny_model: Path) -> None:
    world = make_world()
    world.apply(small("drift", tiny_model))
    world.wait_ready("drift", warm=1, timeout=120)
    want_dep = world.get("deployment", "drift")
    want_svc = world.get("service", "drift")
    want_pdb = world.get("pdb", "drift")

    def container(dep: dict[str, Any]) -> dict[str, Any]:
        return dict(dep["spec"]["template"]["spec"]["containers"][0])

    def shape(dep: dict[str, Any]) -> tuple[Any, ...]:
        c = container(dep)
        return c["image"], c["args"], c["ports"], dep["spec"]["replicas"]

    # Another image the node already has (the operator's): a tag no node has would be pulled.
    other_image = world.cluster.images.get("operator", "evil:latest")
    edits = [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": other_image},
             {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--debug-backdoor"},
             {"op": "replace", "path": "/spec/template/spec/containers/0/ports/0/containerPort", "value": 9999},
             {"op": "replace", "path": "/spec/replicas", "value": 2}]
    edited = json.loads(world.kubectl("patch", "deployment", "drift", "--type=json", "-p", json.dumps(edits),
                                      "-o", "json"))
    assert shape(edited) != shape(want_dep)
    world.kubectl("patch", "service", "drift", "--type=json", "-p", json.dumps([
        {"op": "replace", "path": "/spec/selector", "value": {"app": "elsewhere"}},
        {"op": "add", "path": "/spec/ports/-", "value": {"name": "extra", "port": 9999, "targetPort": 9999}}]))
    world.kubectl("patch", "pdb", "drift", "--type=merge", "-p",
                  json.dumps({"spec": {"selector": {"matchLabels": {"app": "elsewhere"}}}}))

    world.wait(lambda: shape(world.get("deployment", "drift")) == shape(want_dep), 30, "the Deployment restored")
    world.wait(lambda: (lambda s: s["spec"]["selector"] == want_svc["spec"]["selector"]
                        and s["spec"]["ports"] == want_svc["spec"]["ports"])(world.get("service", "drift")), 30,
               "the Service restored (selector, and the extra port gone)")
    world.wait(lambda: world.get("pdb", "drift")["spec"]["selector"] == want_pdb["spec"]["selector"], 30,
               "the PDB restored")
    world.wait_ready("drift", warm=1, timeout=120)
    # The PDB came back by server-side apply as warmpool-operator (the Deployment's merged ports were
    # invalid, a duplicate port name, so it was replaced whole: see the operator log).
    live = json.loads(world.kubectl("get", "pdb", "drift", "-o", "json", "--show-managed-fields"))
    managers = {m["manager"] for m in live["metadata"]["managedFields"] if m.get("operation") == "Apply"}
    assert managers == {"warmpool-operator"}, managers


# --------------------------------------------------------------------------- item 7


@pytest.fixture()
def deny_deployment(cluster: ClusterHandle, namespace: str) -> Iterator[Callable[[str], None]]:
    """Installs a ValidatingAdmissionPolicy (CEL in kube-apiserver, no webhook) and its binding that
    refuse one Deployment name in this namespace; both are removed afterwards."""
    policy = f"warmpool-test-deny-{namespace}"

    def install(name: str) -> None:
        documents = [
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
             "metadata": {"name": policy},
             "spec": {"failurePolicy": "Fail",
                      "matchConstraints": {"resourceRules": [{
                          "apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                          "resources": ["deployments"], "resourceNames": [name]}]},
                      "validations": [{"expression": "false", "message": "refused by the test's policy"}]}},
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
             "metadata": {"name": policy},
             "spec": {"policyName": policy, "validationActions": ["Deny"],
                      "matchResources": {"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": namespace}}}}},
        ]
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(documents))
        probe = yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                                "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                                    "metadata": {"labels": {"a": "b"}},
                                    "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
        deadline = time.monotonic() + 30
        while cluster.kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-", input=probe,
                              check=False).returncode == 0:
            assert time.monotonic() < deadline, "the admission policy never took effect"
            time.sleep(0.5)

    yield install
    cluster.kubectl("delete", "validatingadmissionpolicybinding", policy, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "validatingadmissionpolicy", policy, "--ignore-not-found", check=False)


def test_a_refused_child_heals_once_the_outside_cause_is_fixed(
    make_world: MakeWorld, tiny_model: Path, deny_deployment: Callable[[str], None], cluster: ClusterHandle
) -> None:
    deny_deployment("refused")
    world = make_world(extra_args=("--permanent-retry-interval", "3"))
    world.apply(small("refused", tiny_model))
    cond = world.wait(lambda: (lambda c: c if c.get("reason") == "ChildRejected" else None)(
        world.condition("refused", CONDITION_DEGRADED)), 30, "Degraded ChildRejected")
    assert cond["status"] == "True" and "refused by the test's policy" in cond["message"]
    assert world.maybe("deployment", "refused") is None
    time.sleep(4)  # slow retries (every 3 s here): it stays refused, and says so
    assert world.condition("refused", CONDITION_DEGRADED)["reason"] == "ChildRejected"
    # Lift the policy from outside (no spec edit): the slow retry heals the WarmModel.
    generation = world.wm("refused")["metadata"]["generation"]
    cluster.kubectl("delete", "validatingadmissionpolicybinding", f"warmpool-test-deny-{world.ns}")
    world.wait_ready("refused", warm=1, timeout=120)
    assert world.condition("refused", CONDITION_DEGRADED)["status"] == "False"
    assert world.wm("refused")["metadata"]["generation"] == generation


# --------------------------------------------------------------------------- item 8


def test_an_operator_restart_changes_nothing(make_world: MakeWorld, tiny_model: Path) -> None:
    world = make_world()
    world.apply(small("steady", tiny_model, replicas=2, min_warm=2, max_replicas=3))
    world.wait_ready("steady", warm=2, timeout=150)

    def tiers() -> dict[str, str]:
        return {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(ANNOTATION_TIER, "")
                for p in world.pods("steady")}

    world.wait(lambda: all(t == "full" for t in tiers().values()) and len(tiers()) == 2, 30, "tiers annotated")
    before_tiers = tiers()

    def tier_events() -> int:
        out = world.kubectl("get", "events", "--field-selector", "reason=TierChanged", "-o", "json")
        return len(json.loads(out)["items"])

    # one Event on the WarmModel and one on the pod, per pod
    world.wait(lambda: tier_events() >= 4, 30, "the first TierChanged events posted")
    events_before = tier_events()

    seen: list[int] = []
    stop = threading.Event()

    def watch_replicas() -> None:  # bounded: stops when told, or after 120 s at most
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            dep = world.maybe("deployment", "steady")
            if dep is not None:
                seen.append(int(dep["spec"]["replicas"]))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_replicas, daemon=True)
    watcher.start()
    try:
        world.operator.stop()
        world.operator.start()
        world.wait(lambda: "Handler 'reconcile' succeeded"
                   in world.operator.log().split("===== operator start #2")[-1], 60,
                   "the restarted operator resuming the WarmModel")
        time.sleep(5)  # five passes of the restarted operator
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert seen and min(seen) >= 2, f"the pool scaled down across the restart: {seen}"
    assert tiers() == before_tiers
    assert tier_events() == events_before, "the restarted operator announced tier changes that did not happen"
    world.wait_ready("steady", warm=2, timeout=30)


# --------------------------------------------------------------------------- item 3 (second half)


@pytest.fixture()
def refuse_side_writes(cluster: ClusterHandle, namespace: str) -> Iterator[None]:
    """A ValidatingAdmissionPolicy refusing, in this namespace, any pod that carries the tier
    annotation and any ConfigMap that carries a heat map: the operator's best-effort writes fail."""
    policy = f"warmpool-test-side-writes-{namespace}"
    documents = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{
                      "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                      "resources": ["pods", "configmaps"]}]},
                  "validations": [
                      {"expression": "request.resource.resource != 'pods' || !has(object.metadata.annotations)"
                                     f" || !('{ANNOTATION_TIER}' in object.metadata.annotations)",
                       "message": "pod annotation refused by the test's policy"},
                      {"expression": "request.resource.resource != 'configmaps' || !has(object.data)"
                                     f" || !('{CONFIGMAP_KEY_HEATMAP}' in object.data)",
                       "message": "heat map refused by the test's policy"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy},
         "spec": {"policyName": policy, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {
                      "kubernetes.io/metadata.name": namespace}}}}},
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(documents))
    try:
        deadline = time.monotonic() + 30
        while cluster.kubectl("-n", namespace, "create", "configmap", "probe", "--dry-run=server",
                              f"--from-literal={CONFIGMAP_KEY_HEATMAP}=x", check=False).returncode == 0:
            assert time.monotonic() < deadline, "the admission policy never took effect"
            time.sleep(0.5)
        yield
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicybinding", policy, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "validatingadmissionpolicy", policy, "--ignore-not-found", check=False)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_refused_pod_annotations_and_heat_map_do_not_stop_status(
    make_world: MakeWorld, tiny_model: Path, refuse_side_writes: None
) -> None:
    from tests.support.e2e import http, metric

    port = _free_port()
    world = make_world(heat_write_interval=1, extra_args=("--metrics-port", str(port), "--bind", "127.0.0.1"))
    world.apply(small("sidewrites", tiny_model))
    world.wait_ready("sidewrites", warm=1, timeout=120)  # status is written although every annotation fails
    world.wait(lambda: "heat map not written" in world.operator.log(), 60, "a refused heat-map write")
    log = world.operator.log()
    assert "annotation not written" in log and "pod annotation refused by the test's policy" in log
    pod = world.pods("sidewrites")[0]
    assert ANNOTATION_TIER not in (pod["metadata"].get("annotations") or {})
    text = http(f"http://127.0.0.1:{port}/metrics")[1]
    for target in ("pod_annotation", "heat_map"):
        failures = metric(text, METRIC_OPERATOR_WRITE_FAILURES, **{LABEL_TARGET: target})
        assert failures is not None and failures >= 1, (target, text[-2000:])
    # Status keeps moving with the pods: the generation is observed and the tier counted.
    status = world.wm("sidewrites")["status"]
    assert status["warmReplicas"] == 1 and status["tierCounts"]["full"] == 1
