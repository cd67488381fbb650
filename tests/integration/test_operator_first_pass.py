"""The first pass at the API server's pace (control/pass_queue.py, control/children.py): a real
`warmpool operator` process against a real API server with no controllers (the api_server fixture).

* The writes each new WarmModel costs, counted by the API server itself (its
  ``apiserver_request_total``, write verbs, per resource): the five children and one status; kopf
  writes nothing of its own (app/kopf_state.py: before, its annotations were a seventh write).
* A WarmModel created while the operator works through a backlog of listed WarmModels (a restart
  over many) overtakes it: its first pass is not queued behind the others'.

No node: the Deployments make no pods (no controller runs), so nothing but the operator writes after
the test's creates.  Wall time about 15 s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, model_root
from warmpool.contract.api import API_GROUP_VERSION, CONDITION_READY, KIND, PLURAL

pytestmark = pytest.mark.integration

#: WarmModels created at once for the write count (enough that a write per object stands out).
BURST = 12
#: The backlog a restarted operator lists before the late WarmModel is created.
BACKLOG = 150
#: What the API server may count per new WarmModel: the Secret, ConfigMap, Service, PDB and
#: Deployment created, and one status patch.
WRITES_PER_WARMMODEL = 6
#: Bounds that only catch a hang.
WAIT_S = 90.0
#: The kinds the count covers (the operator's own Lease and Events are not per-WarmModel work).
COUNTED = ("warmmodels", "secrets", "configmaps", "services", "poddisruptionbudgets", "deployments")
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")

T = TypeVar("T")


def _until(check: Callable[[], T | None], within: float, what: str, every: float = 0.1) -> T:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {within:g} s waiting for {what}")


def manifest(name: str) -> dict[str, Any]:
    """A pool that is Ready once reconciled (minWarm 0), its one pod never made (no controllers)."""
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"model": {"hostPath": {"path": str(model_root() / "first-pass")}, "servedName": name},
                     "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 1}}}


def create(cluster: ClusterHandle, namespace: str, names: list[str]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": [manifest(name) for name in names]}
    cluster.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(items))


def ready_names(cluster: ClusterHandle, namespace: str) -> set[str]:
    listed = json.loads(cluster.kubectl("-n", namespace, "get", PLURAL, "-o", "json").stdout)
    return {item["metadata"]["name"] for item in listed["items"]
            if any(c.get("type") == CONDITION_READY and c.get("status") == "True"
                   for c in (item.get("status") or {}).get("conditions") or [])}


def writes(cluster: ClusterHandle) -> dict[str, int]:
    """The API server's count of write requests so far, by resource (and subresource)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name == "apiserver_request_total" and labels.get("verb") in WRITE_VERBS
                    and labels.get("resource") in COUNTED):
                key = "/".join(filter(None, (labels["resource"], labels.get("subresource"))))
                out[key] = out.get(key, 0) + int(sample.value)
    return out


def settled_writes(cluster: ClusterHandle, quiet_s: float = 2.0) -> dict[str, int]:
    """The write counts once they have not moved for ``quiet_s`` (bounded)."""
    last, since = writes(cluster), time.monotonic()
    deadline = since + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = writes(cluster)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"the operator kept writing for {WAIT_S:g} s: {last}")


@pytest.fixture()
def namespace(api_server: ClusterHandle) -> Iterator[str]:
    name = f"first-pass-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        api_server.kubectl("-n", name, "delete", PLURAL, "--all", "--wait=false", check=False)
        for ref in api_server.kubectl("-n", name, "get", PLURAL, "-o", "name", check=False).stdout.split():
            api_server.kubectl("-n", name, "patch", ref, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                               check=False)
        api_server.kubectl("delete", "namespace", name, "--wait=false", check=False)


def start(api_server: ClusterHandle, namespace: str, log: Path) -> Operator:
    operator = Operator(api_server, namespace, log, installed=False, scrape_network="127.0.0.1/32",
                        extra_args=("--scrape-interval", "600"))
    operator.start()
    return operator


def test_a_new_warmmodel_costs_its_five_children_and_one_status(
        api_server: ClusterHandle, namespace: str, tmp_path: Path) -> None:
    operator = start(api_server, namespace, tmp_path / "operator.log")
    try:
        # A first WarmModel: the operator is up and has written its own start-up objects.
        create(api_server, namespace, ["warm-up"])
        _until(lambda: "warm-up" in ready_names(api_server, namespace), WAIT_S, "the first WarmModel Ready")
        before = settled_writes(api_server)
        names = [f"wm-{i:02d}" for i in range(BURST)]
        create(api_server, namespace, names)
        _until(lambda: set(names) <= ready_names(api_server, namespace), WAIT_S, f"{BURST} WarmModels Ready")
        after = settled_writes(api_server)
    finally:
        operator.stop()
    made = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    made["warmmodels"] -= BURST  # the test's own creates
    per_warmmodel = sum(made.values()) / BURST
    print(f"\nwrites per new WarmModel: {per_warmmodel:.2f} ({made})")
    assert per_warmmodel <= WRITES_PER_WARMMODEL, (
        f"{per_warmmodel:.2f} writes per new WarmModel, at most {WRITES_PER_WARMMODEL} expected: {made}\n"
        f"{operator.log()[-3000:]}")
    assert made.get("warmmodels/status", 0) == BURST, f"one status write per WarmModel: {made}"


def deployments_by_write_order(cluster: ClusterHandle, namespace: str) -> list[str]:
    """The Deployments' names in the order the API server made them (by resourceVersion: nothing
    writes a Deployment after its create here, no controller runs)."""
    listed = json.loads(cluster.kubectl("-n", namespace, "get", "deployments", "-o", "json").stdout)["items"]
    return [d["metadata"]["name"] for d in sorted(listed, key=lambda d: int(d["metadata"]["resourceVersion"]))]


def test_a_warmmodel_created_during_the_backlog_overtakes_it(
        api_server: ClusterHandle, namespace: str, tmp_path: Path) -> None:
    # The backlog: WarmModels made while no operator ran, so a starting operator lists them all.
    backlog = [f"old-{i:03d}" for i in range(BACKLOG)]
    create(api_server, namespace, backlog)
    operator = start(api_server, namespace, tmp_path / "operator.log")
    try:
        _until(lambda: deployments_by_write_order(api_server, namespace), WAIT_S, "the backlog's first Deployment",
               every=0.05)
        late = ["late-0", "late-1", "late-2"]
        create(api_server, namespace, late)
        _until(lambda: set(late) <= ready_names(api_server, namespace), WAIT_S, "the late WarmModels Ready")
        ready_then = len(ready_names(api_server, namespace) & set(backlog))
        _until(lambda: set(backlog) <= ready_names(api_server, namespace), WAIT_S, "the backlog Ready", every=0.5)
    finally:
        operator.stop()
    order = deployments_by_write_order(api_server, namespace)
    places = [order.index(name) for name in late]
    print(f"\nthe late WarmModels' Deployments came {places} of {len(order)}; {ready_then} of the {BACKLOG} "
          "listed were Ready when the late ones were")
    # Overtaken: the late ones went ahead of most of the backlog (at most the passes already
    # running when they came, control/pass_queue.py's slots, and those admitted meanwhile).
    assert max(places) < BACKLOG // 2, f"the late WarmModels waited behind the backlog: places {places} of {len(order)}"
