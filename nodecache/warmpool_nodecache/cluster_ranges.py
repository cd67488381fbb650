"""The cluster's own networks, found from the API server, so the node agent refuses them as model
sources without being told (``--cluster-network`` adds to them; ``--source-allow-network`` still
wins, e.g. for an in-cluster object store).

What is found:

* the Service ranges: the ``networking.k8s.io`` ServiceCIDR objects (``v1`` from Kubernetes 1.33,
  where they are always on; ``v1beta1`` where a 1.31/1.32 cluster turned them on).  The API
  server keeps one, ``kubernetes``, for its ``--service-cluster-ip-range``, and any added later
  extends the range.  An API server that serves neither: each ClusterIP of the ``kubernetes``
  Service in ``default`` (the first address of the Service range) widened to the /12 (IPv4) or
  /108 (IPv6) that holds it.  That is sound, not a guess at the convention: without ServiceCIDRs
  the API server refuses a Service range of more than 20 host bits ("the mask must be >= 12",
  ">= 108"), and an aligned block that small holding the address lies inside the one aligned
  /12 (/108) holding it.  The price: addresses of that block outside the real range are refused
  too (allow one with ``--source-allow-network``).
* every Node's pod ranges (``spec.podCIDRs``, else ``spec.podCIDR``) and its addresses
  (``status.addresses``: InternalIP, ExternalIP; names are skipped), each as a single address.

Not found: pod addresses a CNI hands out from pools of its own rather than the Nodes' podCIDRs
(the AWS VPC CNI, Calico's IP pools); name those with ``--cluster-network``.

:func:`keep_discovering` refreshes the networks every ``interval`` (a Node added since is
refused from the next refresh on).  Until one discovery has succeeded every address outside
``--source-allow-network`` is refused (``netguard.LiveNetworks``: an agent that cannot tell a
pod from the internet reads neither); a refresh that fails keeps the networks last found and
warns on this node's Node object.  Lists are asked for at ``resourceVersion=0``, from the API
server's watch cache, so a refresh from every node does not reach etcd.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmpool.kube import KubeClient, KubeError
from warmpool_nodecache import agent_notices as notices
from warmpool_nodecache.netguard import IPNetwork, LiveNetworks

log = logging.getLogger("warmpool.node_agent")

#: Where the ServiceCIDR objects are listed, the GA version first.
SERVICE_CIDR_PATHS = ("/apis/networking.k8s.io/v1/servicecidrs", "/apis/networking.k8s.io/v1beta1/servicecidrs")
#: The ``kubernetes`` Service: its ClusterIPs are the first addresses of the Service ranges.
KUBERNETES_SERVICE = "/api/v1/namespaces/default/services/kubernetes"
NODES = "/api/v1/nodes"
#: Without ServiceCIDRs the API server refuses a Service range with more than 20 host bits:
#: the prefix a ClusterIP is widened to, by IP version (see the module docstring).
LEGACY_SERVICE_PREFIX = {4: 32 - 20, 6: 128 - 20}
#: From the API server's watch cache, not a quorum read of etcd.
FROM_CACHE = {"resourceVersion": "0"}
#: A refresh waits this share of its interval more or less, at random: agents started together
#: do not list the Nodes together for ever after.
JITTER = 0.1


@dataclass(frozen=True)
class ClusterRanges:
    """One discovery's networks, by where they came from."""

    services: tuple[IPNetwork, ...]
    pods: tuple[IPNetwork, ...]
    nodes: tuple[IPNetwork, ...]
    #: How the Service ranges were found (ServiceCIDRs, or the widened ``kubernetes`` Service IP).
    services_from: str

    def networks(self) -> tuple[IPNetwork, ...]:
        """Every network, each once, in the order found."""
        return tuple(dict.fromkeys((*self.services, *self.pods, *self.nodes)))

    def describe(self) -> str:
        def text(nets: tuple[IPNetwork, ...]) -> str:
            shown = ", ".join(str(n) for n in nets[:8])
            return f"{shown} and {len(nets) - 8} more" if len(nets) > 8 else shown or "none"
        return (f"Service {text(self.services)} ({self.services_from}); pods {text(self.pods)}; "
                f"node addresses {text(self.nodes)}")


def _networks(texts: Iterable[Any], what: str) -> list[IPNetwork]:
    """The CIDRs among ``texts``; one that does not parse is logged and skipped (the API server
    validates these fields: a bad one is another writer's bug, not a reason to know nothing)."""
    found: list[IPNetwork] = []
    for text in texts:
        try:
            found.append(ipaddress.ip_network(str(text), strict=False))
        except ValueError:
            log.warning("node agent: %s %r is not a CIDR; skipped", what, text)
    return found


async def service_ranges(kube: KubeClient) -> tuple[tuple[IPNetwork, ...], str]:
    """The Service ranges and how they were found (see the module docstring)."""
    for path in SERVICE_CIDR_PATHS:
        try:
            listed = await kube.request("GET", path, query=FROM_CACHE)
        except KubeError as error:
            if error.status == 404:  # this version is not served: the next, else the fallback
                continue
            raise
        cidrs = [c for item in listed.get("items") or [] for c in ((item.get("spec") or {}).get("cidrs") or [])]
        found = _networks(cidrs, "ServiceCIDR")
        if found:
            return tuple(dict.fromkeys(found)), f"ServiceCIDRs, {path.rsplit('/', 2)[-2]}"
    service = await kube.request("GET", KUBERNETES_SERVICE)
    spec: Mapping[str, Any] = service.get("spec") or {}
    ips = spec.get("clusterIPs") or [spec.get("clusterIP")]
    widened = [ipaddress.ip_network(f"{ip}/{LEGACY_SERVICE_PREFIX[ip.version]}", strict=False)
               for ip in (ipaddress.ip_address(str(text)) for text in ips if text and text != "None")]
    if not widened:
        raise ValueError(f"the kubernetes Service has no ClusterIP ({KUBERNETES_SERVICE}): no Service range found")
    return tuple(widened), "no ServiceCIDRs served: the kubernetes Service's ClusterIP widened"


def node_ranges(nodes: Iterable[Mapping[str, Any]]) -> tuple[tuple[IPNetwork, ...], tuple[IPNetwork, ...]]:
    """(pod ranges, node addresses as single-address networks) of ``nodes``."""
    pods: list[IPNetwork] = []
    addresses: list[IPNetwork] = []
    for node in nodes:
        spec: Mapping[str, Any] = node.get("spec") or {}
        pods += _networks(spec.get("podCIDRs") or [c for c in [spec.get("podCIDR")] if c], "Node podCIDR")
        for address in (node.get("status") or {}).get("addresses") or []:
            text = str(address.get("address", ""))
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue  # a Hostname or DNS name, not an address
            addresses.append(ipaddress.ip_network(ip))
    return tuple(dict.fromkeys(pods)), tuple(dict.fromkeys(addresses))


async def discover(kube: KubeClient) -> ClusterRanges:
    """The cluster's networks as the API server has them now (KubeError when it refuses a read)."""
    services, services_from = await service_ranges(kube)
    listed = await kube.request("GET", NODES, query=FROM_CACHE)
    pods, addresses = node_ranges(listed.get("items") or [])
    return ClusterRanges(services, pods, addresses, services_from)


async def refresh(kube: KubeClient, live: LiveNetworks, said: notices.Notices) -> bool:
    """One discovery into ``live``; a failure keeps what ``live`` holds and warns on the Node."""
    try:
        ranges = await discover(kube)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        held = "refusing every source outside --source-allow-network until it succeeds" \
            if live.networks is None else "the networks found before stay refused"
        text = (f"finding the cluster's networks failed ({type(error).__name__}: {error}); {held}. "
                "The agent needs list on nodes and servicecidrs (or get on the default/kubernetes Service)")
        log.warning("node agent: %s", text)
        await said.warn(said.node_object(), notices.REASON_CLUSTER_NETWORKS_FAILED, text[:1000])
        return False
    if live.networks != ranges.networks():
        log.info("node agent: model sources are not read from the cluster's networks: %s", ranges.describe())
    live.replace(ranges.networks())
    said.clear(said.node_object(), notices.REASON_CLUSTER_NETWORKS_FAILED)
    return True


async def keep_discovering(kube: KubeClient, live: LiveNetworks, said: notices.Notices, interval_s: float) -> None:
    """:func:`refresh` every ``interval_s`` (give or take JITTER), until cancelled."""
    while True:
        await asyncio.sleep(interval_s * random.uniform(1 - JITTER, 1 + JITTER))
        await refresh(kube, live, said)
