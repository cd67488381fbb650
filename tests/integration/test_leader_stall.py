"""A leader whose API connection stalls stops acting before the standby acts (app/leader.py), with
the leader alive, on the real API server.

Two `warmpool operator --leader-elect` processes run against a private API server (the api_server
fixture's store, served by a second kube-apiserver that writes an audit log).  Each has a client
certificate of its own, so the server's log names who made each write.  The leader (A) reaches
the server through a loopback relay (tests/support/stall_proxy.py); the standby (B) directly.
The relay is frozen, new connections too: every connection A holds or dials stalls (its Lease
renewal among them; a dial connects, then nothing passes) while A itself runs on.  B takes the
Lease once the record has stood still for the lease's duration.  Then the stall ends (the relay drops the stalled
connections), and the WarmModel is changed so that an operator still running would write.

Proof, by the API server's own clock: A's last write request was answered before B's first
write request arrived, and A had exited by itself (75: lost the Lease).  With the holder's exit
removed from the renewal loop, A writes again after B's takeover and this test fails.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from warmpool_devcluster.testing import ClusterHandle

from tests.support.audited_api_server import AuditedApiServer, Write
from tests.support.e2e import Operator, model_root, warmmodel
from tests.support.stall_proxy import StallProxy, relay_to_api_server
from warmpool.contract.api import PLURAL

pytestmark = pytest.mark.integration

LEASE = "warmpool-operator"
LEADER, STANDBY = "warmpool-test-leader", "warmpool-test-standby"
#: What app/leader.py exits with when it lost the Lease.
LOST_THE_LEASE = 75
#: Bounds that only catch a hang: an operator starts in a few seconds, a takeover takes the
#: lease's 8 s duration and a retry period or two.
START_S, TAKEOVER_S = 60.0, 60.0

T = TypeVar("T")


def _until(check: Callable[[], T], within: float, what: str, every: float = 0.2) -> T:
    deadline = time.monotonic() + within
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {within:g}s: {what}"
        time.sleep(every)
    return found


@dataclasses.dataclass
class Pair:
    server: AuditedApiServer
    proxy: StallProxy
    leader: Operator
    standby: Operator
    namespace: str
    kubectl: Callable[..., Any]

    def holder(self) -> str:
        found = self.kubectl("get", "lease", LEASE, "-n", self.namespace, "-o", "json", check=False)
        return str(json.loads(found.stdout)["spec"].get("holderIdentity") or "") if found.returncode == 0 else ""

    def writes_of(self, user: str) -> list[Write]:
        return [w for w in self.server.writes() if w.user == user]


@pytest.fixture()
def pair(api_server: ClusterHandle, tmp_path: Path) -> Iterator[Pair]:
    assert api_server.name is not None
    namespace = f"leader-stall-{int(time.time() * 1000) % 10**8}"
    api_server.kubectl("create", "namespace", namespace)
    server = AuditedApiServer(api_server.name, (LEADER, STANDBY), tmp_path / "audited")
    proxy = relay_to_api_server(server.kubeconfig(LEADER, tmp_path / "leader-direct.kubeconfig"),
                                tmp_path / "leader.kubeconfig")
    assert proxy is not None, "the audited API server listens on loopback"
    flags = ("--leader-elect", "--leader-election-namespace", namespace, "--leader-election-name", LEASE)
    leader = Operator(dataclasses.replace(api_server, kubeconfig=tmp_path / "leader.kubeconfig"), namespace,
                      tmp_path / "leader.log", installed=False, extra_args=flags)
    standby = Operator(dataclasses.replace(api_server, kubeconfig=server.kubeconfig(
        STANDBY, tmp_path / "standby.kubeconfig")), namespace, tmp_path / "standby.log", installed=False,
        extra_args=flags)
    made = Pair(server, proxy, leader, standby, namespace, api_server.kubectl)
    try:
        yield made
    finally:
        for operator in (leader, standby):
            operator.stop()
            print(f"\n===== {operator.log_path.name} (tail) =====\n{operator.log()[-3000:]}")
        proxy.close()
        server.close()
        api_server.kubectl("-n", namespace, "delete", PLURAL, "--all", "--wait=false", check=False)
        for ref in api_server.kubectl("-n", namespace, "get", PLURAL, "-o", "name", check=False).stdout.split():
            api_server.kubectl("-n", namespace, "patch", ref, "--type=merge", "-p",
                               '{"metadata":{"finalizers":null}}', check=False)
        api_server.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _poke(pair: Pair, value: str) -> None:
    """A change to the WarmModel that any acting operator answers with writes (its pass)."""
    pair.kubectl("-n", pair.namespace, "annotate", "--overwrite", f"{PLURAL}/stall", f"test.warmpool.dev/poke={value}")


def test_a_stalled_leader_stops_acting_before_the_standby_acts(pair: Pair) -> None:
    # A alone: it takes the Lease and acts (the WarmModel's children are its writes).
    pair.leader.start()
    leader_identity = _until(pair.holder, START_S, "the first operator holding the Lease")
    pair.standby.start()
    pair.kubectl("apply", "-n", pair.namespace, "-f", "-",
                 input=json.dumps(warmmodel("stall", model_root() / "leader-stall")))
    _until(lambda: any(w.resource == "deployments" for w in pair.writes_of(LEADER)), START_S,
           "the leader writing the WarmModel's Deployment")
    # B waits: a standby writes nothing.
    _until(lambda: "waiting for the Lease" in pair.standby.log(), START_S, "the second operator waiting as standby")
    assert pair.writes_of(STANDBY) == [], "the standby wrote while another held the Lease"

    # The stall: every connection A holds or opens stops carrying bytes; A itself runs on.
    assert pair.proxy.freeze(new_too=True) > 0, "the leader held no connection through the relay"
    stalled = time.monotonic()
    _until(lambda: pair.holder() not in ("", leader_identity), TAKEOVER_S, "the standby taking the Lease")
    print(f"\nthe standby took the Lease {time.monotonic() - stalled:.1f}s after the stall began")

    # The stall ends; any operator still running sees the WarmModel change and writes.
    pair.proxy.cut()
    _poke(pair, "after-takeover")
    first = _until(lambda: pair.writes_of(STANDBY), 10, "the standby's Lease write in the audit log")[0]
    _until(lambda: any(w.received > first.received and w.resource != "leases" for w in pair.writes_of(STANDBY))
           and (not pair.leader.running() or any(w.received >= first.received for w in pair.writes_of(LEADER))),
           TAKEOVER_S, "the new leader acting on the change, and the old one gone or caught acting")

    leader_writes = pair.writes_of(LEADER)
    late = [str(w) for w in leader_writes if w.received >= first.received or w.answered >= first.received]
    assert first.resource == "leases", f"the standby's first write was not taking the Lease: {first}"
    assert not late, f"the old leader wrote after the standby's first write ({first}):\n" + "\n".join(late)
    assert leader_writes and max(w.answered for w in leader_writes) < first.received
    assert not pair.leader.running(), "the old leader is still running after the takeover"
    assert pair.leader.proc is not None and pair.leader.proc.returncode == LOST_THE_LEASE, pair.leader.log()[-2000:]
    assert "lost the Lease" in pair.leader.log() and "renewal failed: TimeoutError" in pair.leader.log()
