"""Which addresses a model source may make the node agent connect to.

A WarmModel's author names the URL, so without a check a spec could make every node's agent
read the node's own services (loopback), a cloud's metadata service, the API server and
in-cluster Services or pods on the author's behalf.  An :class:`AddressPolicy` refuses, by
default, :data:`ALWAYS_REFUSED` -- loopback, link-local, "this network" (0.0.0.0/8, which Linux
routes to the host), multicast and broadcast, and every cloud metadata address a node can reach
-- plus the cluster's own networks: those the agent finds itself (``cluster_ranges.py``: the
Service ranges, the Nodes' pod ranges and addresses; held in a :class:`LiveNetworks`, refreshed
while the agent runs) and those it is given (``--cluster-network``).  Until the first discovery
has succeeded every address is refused: an agent that does not know the cluster's ranges yet
cannot tell a pod from the internet.  An address inside an allowed network
(``--source-allow-network``, e.g. an in-cluster object store's Service IP) is accepted even
when a refused range holds it.

IPv6 addresses that carry an IPv4 address the network delivers to -- IPv4-mapped (``::ffff:``),
IPv4-translated (``::ffff:0:``), IPv4-compatible (``::/96``), NAT64's well-known prefix
(``64:ff9b::/96``, which a NAT64 gateway turns into the IPv4 address), 6to4 (``2002::/16``) and
Teredo (``2001::/32``: its server and client) -- are judged by that IPv4 address too, so
``64:ff9b::a9fe:a9fe`` is refused as 169.254.169.254 is.  NAT64's local-use prefix
(``64:ff9b:1::/48``) is refused whole: where it carries the IPv4 address is the network's choice.

The host is resolved once and *every* address it resolves to is checked (a name that also
resolves to an internal address is refused whole); the connection is then made to one of the
checked addresses, never by resolving the name again, so a DNS answer that changes between
the check and the connect (rebinding) cannot swap the address.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from warmpool_nodecache.source_errors import SourceError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Refused whatever the flags say about cluster networks (each is reachable from a node
#: without a route of the cluster's own).
ALWAYS_REFUSED: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "::1/128",  # loopback: the node's own services (kubelet, agent ports)
    # link-local: AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean and others serve their
    # metadata at 169.254.169.254 (AWS's DNS and time servers are link-local too)
    "169.254.0.0/16", "fe80::/10",
    "0.0.0.0/8", "::/128",  # "this network": connect() to 0.0.0.0 reaches the host itself
    "224.0.0.0/4", "ff00::/8", "255.255.255.255/32",  # multicast and broadcast
    "100.100.100.200/32",  # Alibaba Cloud's metadata service
    "168.63.129.16/32",  # Azure's host address (WireServer: the VM agent's certificates and goal state)
    # IETF protocol assignments: Oracle Cloud Classic's metadata service (192.0.0.192), DS-Lite
    # and NAT64 discovery; nothing a model is served from
    "192.0.0.0/24",
    "fd00:ec2::/32",  # AWS's IPv6 services: its metadata service fd00:ec2::254, DNS ::253, time ::123
    "fd20:ce::254/128",  # GCP's IPv6 metadata service
    "64:ff9b:1::/48",  # NAT64's local-use prefix (RFC 8215): where it carries the IPv4 address varies
))

#: IPv6 prefixes whose last 32 bits are an IPv4 address the network delivers to (see the module docstring).
_LOW_32_BITS_IPV4: tuple[ipaddress.IPv6Network, ...] = tuple(ipaddress.IPv6Network(n) for n in (
    "64:ff9b::/96",  # NAT64's well-known prefix (RFC 6052): a NAT64 gateway translates to it
    "::ffff:0:0:0/96",  # IPv4-translated (SIIT, RFC 2765)
    "::/96",  # IPv4-compatible (deprecated, RFC 4291); ::1 and :: are refused as themselves first
))


class AddressRefusedError(SourceError):
    """The source's host resolves to an address the policy refuses (the message names the range)."""


def parse_network(text: str, flag: str) -> IPNetwork:
    """A CIDR from a flag's value; ValueError naming the flag and the value when it is not one."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a CIDR network (e.g. 10.96.0.0/12 or fd00::/64)") from None


def _plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def embedded_ipv4(address: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries and the network may deliver to (NAT64's
    well-known prefix, IPv4-translated and -compatible forms, 6to4, Teredo's server and client)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    if any(address in prefix for prefix in _LOW_32_BITS_IPV4):
        return (ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return address.teredo
    return ()


class LiveNetworks:
    """Networks found while the agent runs (the cluster's own, ``cluster_ranges.py``): one tuple
    swapped whole, so a reader in any thread sees one discovery's networks, never half of two.
    ``None`` until the first discovery: the policy then refuses every address not allowed."""

    def __init__(self, networks: Iterable[IPNetwork] | None = None) -> None:
        self._networks: tuple[IPNetwork, ...] | None = None if networks is None else tuple(networks)

    @property
    def networks(self) -> tuple[IPNetwork, ...] | None:
        return self._networks

    def replace(self, networks: Iterable[IPNetwork]) -> None:
        self._networks = tuple(networks)


@dataclass(frozen=True)
class AddressPolicy:
    """Refused and allowed networks (see the module docstring); the default refuses only
    :data:`ALWAYS_REFUSED`: give it the cluster's networks (``discovered``, ``cluster_networks``)."""

    cluster_networks: tuple[IPNetwork, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = ()
    #: The cluster's networks the agent found itself (None: no discovery, only the flags' networks).
    discovered: LiveNetworks | None = None

    @classmethod
    def from_flags(cls, cluster: Iterable[str], allowed: Iterable[str],
                   discovered: LiveNetworks | None = None) -> AddressPolicy:
        return cls(tuple(parse_network(n, "--cluster-network") for n in cluster),
                   tuple(parse_network(n, "--source-allow-network") for n in allowed), discovered)

    def refusal(self, address: IPAddress) -> str | None:
        """Why ``address`` is refused (the range that holds it), or None when it may be used."""
        plain = _plain(address)
        if any(plain in net for net in self.allowed_networks if net.version == plain.version):
            return None
        found = None if self.discovered is None else self.discovered.networks
        for kind, networks in (("a loopback, link-local, metadata or other host-internal", ALWAYS_REFUSED),
                               ("a cluster", self.cluster_networks),
                               ("a cluster", found or ())):
            for net in networks:
                if net.version == plain.version and plain in net:
                    return f"{kind} range ({net})"
        for inner in embedded_ipv4(plain):
            why = self.refusal(inner)
            if why is not None:
                return f"{why}, as the IPv4 address {inner} it carries"
        if self.discovered is not None and found is None:
            return "an unchecked range (the cluster's own networks are not found yet)"
        return None

    def check(self, host: str, addresses: Iterable[str]) -> None:
        """AddressRefusedError when any of ``host``'s resolved ``addresses`` is refused."""
        for text in addresses:
            why = self.refusal(ipaddress.ip_address(text.split("%", 1)[0]))
            if why is not None:
                raise AddressRefusedError(
                    f"source host {host!r} resolves to {text}, in {why}: the node agent does not read "
                    "model sources there (allow it with --source-allow-network)")


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for TCP, in the resolver's order, each once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise SourceError(f"source host {host!r} does not resolve ({exc})") from None
    seen: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in seen:
            seen.append(address)
    if not seen:
        raise SourceError(f"source host {host!r} resolves to no address")
    return seen
