"""hostPath has a boundary (#12 item 9), on the real local control plane with the real operator:
a WarmModel whose hostPath (or nodeCache root/key) lies outside the operator's
--allowed-host-path prefixes is Degraded with reason HostPathNotAllowed and gets no child and
no pod; one under an allowed prefix goes warm; moving the refused one under a prefix heals it.

The local test operator allows the temp dir and the model caches (tests.support.e2e.local_model_dirs)
and the defaults are not in play, so /etc and /var/lib/kubelet are outside every prefix.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.rules import status

from tests.support.e2e import Operator, World, delete_warmmodels, warmmodel
from warmpool.contract.api import CONDITION_DEGRADED, CONDITION_READY

pytestmark = pytest.mark.integration


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False)
    operator.start()
    w = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield w
    finally:
        delete_warmmodels(cluster, namespace)
        operator.stop()
        w.close()


def with_model(body: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"]["model"] = {**model, "revision": out["spec"]["model"].get("revision", "r1")}
    return out


def refused(world: World, name: str) -> dict[str, Any]:
    world.wait(lambda: world.condition(name, CONDITION_DEGRADED).get("status") == "True", 60,
               f"{name}: Degraded=True")
    return world.condition(name, CONDITION_DEGRADED)


def test_a_host_path_outside_the_prefixes_is_degraded_and_gets_no_pod(world: World, tiny_model: Path) -> None:
    base = warmmodel("tiny", tiny_model)
    world.apply(with_model(base, {"hostPath": {"path": "/etc"}}) | {"metadata": {"name": "etc"}})
    world.apply(with_model(base, {"nodeCache": {"root": "/var", "key": "lib/kubelet"}})
                | {"metadata": {"name": "kubelet"}})
    world.apply(base)  # under the temp dir: allowed

    etc = refused(world, "etc")
    assert etc["reason"] == status.REASON_HOST_PATH_NOT_ALLOWED
    assert "/etc" in etc["message"] and "--allowed-host-path" in etc["message"]
    kubelet = refused(world, "kubelet")
    assert kubelet["reason"] == status.REASON_HOST_PATH_NOT_ALLOWED and "/var/lib/kubelet" in kubelet["message"]
    assert world.condition("etc", CONDITION_READY).get("status") == "False"

    # The allowed one goes warm: the operator was working all along, and still made nothing
    # for the refused ones.
    world.wait_ready("tiny", warm=1, timeout=150)
    for name in ("etc", "kubelet"):
        assert not any(world.children(name).values()), world.children(name)
        assert world.pods(name) == []
    world.wait(lambda: any(e["reason"] == status.REASON_HOST_PATH_NOT_ALLOWED
                           for e in world.get("events", "--field-selector", "involvedObject.name=etc")["items"])
               or None, 30, "a HostPathNotAllowed Event on the WarmModel")

    # Moving the model under an allowed prefix heals it (a new generation is tried at once).
    world.apply(with_model(base, {"hostPath": {"path": str(tiny_model)}}) | {"metadata": {"name": "etc"}})
    world.wait(lambda: world.condition("etc", CONDITION_DEGRADED).get("status") == "False", 60,
               "etc: Degraded=False once its hostPath is allowed")
    world.wait_ready("etc", warm=1, timeout=150)
