"""Two teams on the real node (issue 40): team A's pod tries every route through the shared
activator to team B's pool, at zero and warm, while team B's own pod is served.

Team B's namespace has the chart's worker NetworkPolicy (its workers take their port only from its
own pods, the activator and the operator); the activator (two replicas of the operator's image, as
the chart runs it, tests/e2e/test_e2e_zero.py's) applies that policy to whoever calls it.  Team A,
from a pod of its own namespace: through the pool's ClusterIP and straight at each activator
replica with every Host that names team B's pool, and by traversal paths.  A forged EndpointSlice
(the right labels, no owner) never becomes the pool's pods.  Nothing crosses; team B's requests are
held and answered with the engine's greedy text.

The policy itself (team A straight at a worker pod's port) is enforced, by the project's own
enforcer, in test_e2e_network_policies.py (docs/reliability.md MT25).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_bench import zero_activator as activator
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, pod_ready, run_pod, tiny_model, warmmodel
from warmpool.contract.http import DEFAULT_WORKER_PORT, WORKER_PORT_NAME
from warmpool.contract.pods import COMPONENT_WORKER, LABEL_COMPONENT
from warmpool.contract.zero import (
    DEFAULT_ACTIVATOR_PORT,
    ENDPOINTSLICE_MANAGER,
    LABEL_ENDPOINTSLICE_MANAGED_BY,
    LABEL_SERVICE_NAME,
)

#: What each client pod runs: one request per route, its status (0: no connection) and the first
#: bytes of its answer, as JSON lines.  Bounded: one try per route, 5 s each.
PROBE = textwrap.dedent("""
    import http.client, json, sys
    for route in json.loads(sys.argv[1]):
        connection = http.client.HTTPConnection(route["ip"], route["port"], timeout=route.get("timeout", 5))
        try:
            body = json.dumps({"model": "b", "prompt": "hello there", "max_tokens": 4, "temperature": 0})
            connection.putrequest("POST", route["path"], skip_host=True, skip_accept_encoding=True)
            for name, value in (("Host", route["host"]), ("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))):
                connection.putheader(name, value)
            connection.endheaders(body.encode())
            answer = connection.getresponse()
            print(json.dumps({**route, "status": answer.status, "body": answer.read()[:300].decode(errors="replace")}))
        except OSError as error:
            print(json.dumps({**route, "status": 0, "body": type(error).__name__}))
        finally:
            connection.close()
""")


@pytest.fixture()
def two_teams(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[tuple[World, str]]:
    if cluster.node is None or "operator" not in cluster.images:
        pytest.skip("the activator and the clients run from the project's operator image on the real node")
    team_a = f"{namespace[:50]}-a"
    cluster.kubectl("create", "namespace", team_a)
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--activator-service", f"{namespace}/{activator.NAME}"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        for obj in activator.activator_objects(cluster.images["operator"], namespace):
            world.apply(obj)
        world.apply(_worker_policy())
        yield world, team_a
    finally:
        logs = cluster.kubectl("-n", namespace, "logs", "-l", activator.SELECTOR, "--tail=40", "--prefix",
                               check=False)
        print("\n===== activator logs (tail) =====\n" + logs.stdout + logs.stderr)
        cluster.kubectl("-n", namespace, "delete", "warmmodels", "--all", "--timeout=60s", check=False)
        cluster.kubectl("delete", "namespace", team_a, "--wait=false", check=False)
        operator.stop()
        world.close()


def _worker_policy() -> dict[str, Any]:
    """The chart's worker policy in team B's namespace: the workers' port, from its own pods only
    (the activator runs there too; the operator runs on the node, which a policy never isolates)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "workers"},
            "spec": {"podSelector": {"matchLabels": {LABEL_COMPONENT: COMPONENT_WORKER}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": WORKER_PORT_NAME}]}]}}


def _probe(world: World, namespace: str, name: str, routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    phase, log = run_pod(world.cluster, namespace, name, world.cluster.images["operator"],
                         ["python3", "-c", PROBE, json.dumps(routes)], timeout=300)
    assert phase == "Succeeded", log
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def _activator_ips(world: World) -> list[str]:
    found = json.loads(world.kubectl("get", "pods", "-l", activator.SELECTOR, "-o", "json"))
    return [p["status"]["podIP"] for p in found["items"] if pod_ready(p)]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_another_teams_pod_reaches_no_route_to_a_pool_while_its_own_team_is_served(
        two_teams: tuple[World, str]) -> None:
    world, team_a = two_teams
    body = warmmodel("b", tiny_model(), replicas=1, min_warm=1)
    body["spec"]["pool"]["scaleToZero"] = {"afterIdleSeconds": 6, "holdTimeoutSeconds": 240, "maxHeldRequests": 5}
    world.apply(body)
    world.wait(lambda: len(_activator_ips(world)) == 2, 240, "two activator replicas")
    world.wait_ready("b", warm=1, timeout=240)
    world.wait(lambda: world.get("deployment", "b")["spec"]["replicas"] == 0 and not world.pods("b"), 180,
               "the pool idle to zero")
    world.kubectl("patch", "warmmodels/b", "--type=merge", "-p",
                  json.dumps({"spec": {"pool": {"scaleToZero": {"afterIdleSeconds": 600}}}}))
    cluster_ip = world.get("service", "b")["spec"]["clusterIP"]
    ns_b = world.ns
    hosts = [cluster_ip, f"b.{ns_b}", f"b.{ns_b}.svc.cluster.local"]
    # A forged slice: the Service's label and the operator's manager label, no owner: never the pool's pods.
    forged_labels = {LABEL_SERVICE_NAME: "b", LABEL_ENDPOINTSLICE_MANAGED_BY: ENDPOINTSLICE_MANAGER}
    world.apply({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                 "metadata": {"name": "b-pods-forged", "labels": forged_labels},
                 "ports": [{"name": "http", "port": DEFAULT_ACTIVATOR_PORT}],
                 "endpoints": [{"addresses": [_activator_ips(world)[0]], "conditions": {"ready": True}}]})

    # -- at zero: team A through the Service and straight at each activator replica, every Host.
    at_zero = [{"ip": ip, "port": port, "host": host, "path": "/v1/completions"}
               for ip, port in [(cluster_ip, DEFAULT_WORKER_PORT)] + [(a, DEFAULT_ACTIVATOR_PORT)
                                                                       for a in _activator_ips(world)]
               for host in hosts]
    seen = _probe(world, team_a, "a-at-zero", at_zero)
    assert len(seen) == len(at_zero) and {r["status"] for r in seen} == {421}, seen
    assert world.get("deployment", "b")["spec"]["replicas"] == 0, "team A's requests started team B's pool"
    assert not [k for k in world.wm("b")["metadata"].get("annotations") or {} if k.startswith("held.")]

    # -- team B's own pod at zero: held, a pod started for it, answered.
    (served,) = _probe(world, ns_b, "b-at-zero", [{"ip": cluster_ip, "port": DEFAULT_WORKER_PORT, "host": "b",
                                                    "path": "/v1/completions", "timeout": 240}])
    assert served["status"] == 200, served
    world.wait_ready("b", warm=1, timeout=240)
    pod = world.pods("b")[0]
    reference = world.complete(pod, "b", "hello there", max_tokens=4)
    assert json.loads(served["body"])["choices"][0]["text"] == reference

    # -- warm: team A through the activator, with traversal paths and the serving API.
    pod_ip = pod["status"]["podIP"]
    traversal = [{"ip": a, "port": DEFAULT_ACTIVATOR_PORT, "host": f"b.{ns_b}", "path": p}
                 for a in _activator_ips(world)[:1]
                 for p in ("/v1/../metrics", "/v1/%2e%2e/control/tier", "/metrics", "/v1/completions")]
    through = _probe(world, team_a, "a-warm", traversal)
    assert [r["status"] for r in through] == [404, 404, 404, 421], through
    # Team B's own pod is served straight from the pod, and its traversal is refused by the activator.
    own = _probe(world, ns_b, "b-warm", [
        {"ip": pod_ip, "port": DEFAULT_WORKER_PORT, "host": "b", "path": "/v1/completions"},
        {"ip": _activator_ips(world)[0], "port": DEFAULT_ACTIVATOR_PORT, "host": "b", "path": "/v1/../metrics"}])
    assert [r["status"] for r in own] == [200, 404], own
    assert json.loads(own[0]["body"])["choices"][0]["text"] == reference
