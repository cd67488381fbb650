"""The node agent finds the cluster's own networks on a real API server (no controllers, no node:
the test makes the Nodes), and says one thing of every model source that failed.

* Discovery: the ServiceCIDRs the API server keeps, every Node's pod ranges and addresses; a Node
  added later after the next refresh; without ServiceCIDRs, the ``kubernetes`` Service's IP
  widened to its /12.
* The agent as a whole (in this process, on the API server): it finds the networks before its
  first read, and a source that is refused, missing, forbidden, failing or silent reads the same
  in its WarmModel's status and Events.  Sources are on loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config
from warmpool_devcluster.node_network import SERVICE_CIDR
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache import cluster_ranges
from warmpool_nodecache.agent_kube import AgentKube
from warmpool_nodecache.agent_loop import Agent, AgentConfig
from warmpool_nodecache.agent_notices import Notices
from warmpool_nodecache.netguard import AddressPolicy, LiveNetworks
from warmpool_nodecache.source import ReadLimits
from warmpool_nodecache.source_errors import unavailable_text

from tests.integration.test_node_agent import http_warmmodel
from tests.support.hostile_server import fixed, hostile_server
from warmpool.contract.files import MANIFEST_FILENAME
from warmpool.kube import MERGE_PATCH, KubeError

pytestmark = pytest.mark.integration

NODES = "/api/v1/nodes"


@contextlib.asynccontextmanager
async def _kube(api_server: ClusterHandle, node: str) -> AsyncIterator[AgentKube]:
    kube = AgentKube(await kube_config.new_client_from_config(config_file=str(api_server.kubeconfig)), node)
    try:
        yield kube
    finally:
        await kube.close()


def _node(name: str, pod_cidrs: list[str], addresses: list[tuple[str, str]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "spec": {"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs} if pod_cidrs else {},
            "status": {"addresses": [{"type": kind, "address": address} for kind, address in addresses]}}


async def _create_node(kube: AgentKube, body: dict[str, Any]) -> None:
    await kube.request("POST", NODES, body=body)
    # The addresses go through the status subresource, as a kubelet's do.
    await kube.request("PATCH", f"{NODES}/{body['metadata']['name']}/status",
                       body={"status": body["status"]}, content_type=MERGE_PATCH)


@contextlib.asynccontextmanager
async def _nodes(kube: AgentKube, *bodies: dict[str, Any]) -> AsyncIterator[list[str]]:
    """Nodes made for the test and deleted after it (the API server is shared by the session)."""
    made: list[str] = []
    try:
        for body in bodies:
            await _create_node(kube, body)
            made.append(body["metadata"]["name"])
        yield made
    finally:
        for name in made:
            with contextlib.suppress(KubeError):
                await kube.request("DELETE", f"{NODES}/{name}")


def _nets(*texts: str) -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return {ipaddress.ip_network(t) for t in texts}


async def test_discovery_finds_the_service_range_pod_ranges_and_node_addresses(
    api_server: ClusterHandle, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tag = uuid.uuid4().hex[:6]
    first = _node(f"ranges-a-{tag}", ["10.244.1.0/24", "fd00:10:244:1::/64"],
                  [("InternalIP", "172.18.0.3"), ("InternalIP", "fc00:f853:ccd:e793::3"), ("Hostname", "a")])
    second = _node(f"ranges-b-{tag}", ["10.244.2.0/24"], [("ExternalIP", "203.0.113.10"), ("InternalDNS", "b.x")])
    async with _kube(api_server, first["metadata"]["name"]) as kube, _nodes(kube, first, second) as made:
        ranges = await cluster_ranges.discover(kube)
        # The API server of a 1.34 cluster keeps its --service-cluster-ip-range as a ServiceCIDR.
        assert ranges.services == (ipaddress.ip_network(SERVICE_CIDR),), ranges
        assert ranges.services_from.startswith("ServiceCIDRs, v1"), ranges.services_from
        assert _nets("10.244.1.0/24", "fd00:10:244:1::/64", "10.244.2.0/24") <= set(ranges.pods), ranges
        assert _nets("172.18.0.3/32", "fc00:f853:ccd:e793::3/128", "203.0.113.10/32") <= set(ranges.nodes), ranges

        live = LiveNetworks()
        policy = AddressPolicy(discovered=live)
        assert policy.refusal(ipaddress.ip_address("198.51.100.1")) is not None  # nothing known yet: refused
        said = Notices(kube, made[0])
        assert await cluster_ranges.refresh(kube, live, said)
        for inside in ("10.96.0.1", "10.244.2.77", "fd00:10:244:1::5", "172.18.0.3", "203.0.113.10"):
            assert "a cluster range" in str(policy.refusal(ipaddress.ip_address(inside))), inside
        assert policy.refusal(ipaddress.ip_address("198.51.100.1")) is None
        assert policy.refusal(ipaddress.ip_address("10.244.3.1")) is None  # no Node has it (yet)

        # A Node that joins later is refused from the next refresh on.
        third = _node(f"ranges-c-{tag}", ["10.244.3.0/24"], [("InternalIP", "172.18.0.5")])
        async with _nodes(kube, third):
            assert await cluster_ranges.refresh(kube, live, said)
            assert "a cluster range" in str(policy.refusal(ipaddress.ip_address("10.244.3.1")))
            assert "a cluster range" in str(policy.refusal(ipaddress.ip_address("172.18.0.5")))

        # An API server that serves no ServiceCIDRs (before 1.33): the kubernetes Service's
        # ClusterIP (the Service range's first address) widened to the /12 holding it.
        monkeypatch.setattr(cluster_ranges, "SERVICE_CIDR_PATHS", ("/apis/networking.k8s.io/v0/servicecidrs",))
        services, how = await cluster_ranges.service_ranges(kube)
        assert services == (ipaddress.ip_network("10.96.0.0/12"),) and "widened" in how, (services, how)
        assert ipaddress.IPv4Network(SERVICE_CIDR).subnet_of(ipaddress.IPv4Network(services[0]))


def _closed_port() -> int:
    with socket.socket() as probe:  # a port just released: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_the_agent_finds_the_cluster_first_and_says_the_same_of_every_failed_source(
    api_server: ClusterHandle, tmp_path: Path,
) -> None:
    namespace = f"ranges-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    node = f"ranges-agent-{namespace}"
    with hostile_server("127.0.0.2") as canary, hostile_server("127.0.0.1") as server:
        server.state.routes[f"/missing/{MANIFEST_FILENAME}"] = fixed(b"{}", status=404)
        server.state.routes[f"/forbidden/{MANIFEST_FILENAME}"] = fixed(b"{}", status=403)
        server.state.routes[f"/failing/{MANIFEST_FILENAME}"] = fixed(b"{}", status=500)
        urls = {"refused": f"{canary.url}/m",  # loopback outside the allowed address: an internal endpoint
                "missing": f"{server.url}/missing", "forbidden": f"{server.url}/forbidden",
                "failing": f"{server.url}/failing", "silent": f"http://127.0.0.1:{_closed_port()}/m"}
        for name, url in urls.items():
            body = http_warmmodel(name, url, node)
            body["metadata"]["namespace"] = namespace
            api_server.kubectl("apply", "-f", "-", input=json.dumps(body))
        config = AgentConfig(node=node, cache_root=tmp_path / "cache", namespace=namespace,
                             lease_namespace=namespace, interval_s=1.0, lease_duration_s=5.0,
                             policy=AddressPolicy.from_flags([], ["127.0.0.1/32"], LiveNetworks()),
                             limits=ReadLimits(deadline_s=5.0))
        async with _kube(api_server, node) as kube, _nodes(kube, _node(node, ["10.244.9.0/24"], [])):
            agent = Agent(config, kube)
            stop = asyncio.Event()
            running = asyncio.create_task(agent.run(stop))
            try:
                messages = await _messages(kube, namespace, set(urls), within=60)
                # Found at the start, before the first read: the agent's own Node's pod range among them.
                assert config.policy.discovered is not None
                assert ipaddress.ip_network("10.244.9.0/24") in (config.policy.discovered.networks or ())
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
        events = json.loads(api_server.kubectl("-n", namespace, "get", "events", "-o", "json").stdout)["items"]
        api_server.kubectl("delete", "namespace", namespace, "--wait=false")
    assert messages == {name: unavailable_text(url) for name, url in urls.items()}, messages
    said = {e["involvedObject"]["name"]: e["message"].split(": ", 1)[1] for e in events
            if e.get("reason") == "NodeCacheReadFailed"}
    assert said == messages, said
    assert canary.state.count() == 0, canary.state.requests


async def _messages(kube: AgentKube, namespace: str, names: set[str], within: float) -> dict[str, str]:
    """Each WarmModel's status message from the agent, once every one has one (polled, bounded)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = {wm["metadata"]["name"]: str(entry["message"]) for wm in await kube.warmmodels(namespace)
                 for entry in (wm.get("status") or {}).get("cacheNodes") or [] if entry.get("message")}
        if names <= found.keys():
            return found
        assert asyncio.get_running_loop().time() < deadline, f"no message yet for {sorted(names - found.keys())}"
        await asyncio.sleep(0.2)
