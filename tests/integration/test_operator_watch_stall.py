"""A watch that stalls while the API server stays up is given up and started again (issue #14).

The operator reaches the real API server through a loopback relay (tests/support/stall_proxy.py).
Freezing the relay stalls every connection the operator holds -- its watches carry nothing more,
not even the server's end of them -- while the API server itself stays healthy.  With a
ten-minute scrape interval, only a watch the operator re-established after the stall can tell it
that a child was deleted.  Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import Operator, World, delete_warmmodels, warmmodel
from tests.support.stall_proxy import StallProxy, relay_to_api_server

pytestmark = pytest.mark.integration

STEADY_MEMORY = [f"--memory-capacity-bytes={64 * 1024**3}"]
#: The server would end a watch only after ten minutes (and through a frozen relay even that end
#: would never arrive): only the operator's inactivity bound can give a stalled watch up in time.
WATCH_SERVER_TIMEOUT_S = 600
WATCH_INACTIVITY_TIMEOUT_S = 10
#: How long the test waits for the deleted child: the inactivity bound, a redial and one pass.
RECOVERY_WAIT_S = WATCH_INACTIVITY_TIMEOUT_S + 50


@pytest.fixture()
def stalled(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[tuple[World, StallProxy]]:
    proxied = tmp_path / "kubeconfig-through-relay"
    proxy = relay_to_api_server(cluster.kubeconfig, proxied)
    if proxy is None:
        pytest.skip("relays the operator's API connections over loopback: only on a loopback API server")
    operator = Operator(dataclasses.replace(cluster, kubeconfig=proxied), namespace, tmp_path / "operator.log",
                        installed=False,
                        extra_args=("--scrape-interval", "600",
                                    "--watch-server-timeout", str(WATCH_SERVER_TIMEOUT_S),
                                    "--watch-inactivity-timeout", str(WATCH_INACTIVITY_TIMEOUT_S)))
    operator.start()
    made = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield made, proxy
    finally:
        delete_warmmodels(cluster, namespace)
        operator.stop()
        made.close()
        proxy.close()


def test_a_stalled_watch_is_abandoned_and_started_again(stalled: tuple[World, StallProxy],
                                                        tiny_model: Path) -> None:
    world, proxy = stalled
    world.apply(warmmodel("stall", tiny_model, worker_args=STEADY_MEMORY))
    # The operator's first pass made the Service: that child is all the test needs (a warm pod would
    # add half a minute and test nothing more here).
    world.wait(lambda: world.maybe("service", "stall"), 150, "the WarmModel's Service")

    frozen = proxy.freeze()
    assert frozen > 0, "the operator held no connection through the relay"
    # The API server is healthy (the test's own kubectl goes straight to it); the operator's
    # watches are silent.  Only a watch it dialled again after the stall reports this deletion.
    old_uid = world.get("service", "stall")["metadata"]["uid"]
    world.kubectl("delete", "service", "stall", "--wait=true")
    world.wait(lambda: (world.maybe("service", "stall") or {}).get("metadata", {}).get("uid") not in (None, old_uid),
               RECOVERY_WAIT_S, "the Service deleted during the stall made again")
    assert proxy.accepted_since_freeze > 0, "restored without a new connection: the stall did not stall"
    assert world.operator.running(), "the operator exited over a stalled watch"
