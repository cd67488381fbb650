"""Which addresses a model source may make the node agent connect to.

A WarmModel's author names the URL, so without a check a spec could make every node's agent
read the node's own services (loopback), the cloud metadata service (link-local), the API
server and in-cluster Services or pods on the author's behalf.  An :class:`AddressPolicy`
refuses, by default, loopback, link-local, "this network" (0.0.0.0/8, which Linux routes to
the host), multicast and broadcast addresses, plus the cluster networks it is given (the
Service and pod ranges: ``--cluster-network``).  An address inside an allowed network
(``--source-allow-network``, e.g. an in-cluster object store's Service IP) is accepted even
when a refused range holds it.

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
    "169.254.0.0/16", "fe80::/10",  # link-local: the cloud metadata service lives here
    "0.0.0.0/8", "::/128",  # "this network": connect() to 0.0.0.0 reaches the host itself
    "224.0.0.0/4", "ff00::/8", "255.255.255.255/32",  # multicast and broadcast
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


@dataclass(frozen=True)
class AddressPolicy:
    """Refused and allowed networks (see the module docstring); the default refuses only
    :data:`ALWAYS_REFUSED`: give it the cluster's networks."""

    cluster_networks: tuple[IPNetwork, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_flags(cls, cluster: Iterable[str], allowed: Iterable[str]) -> AddressPolicy:
        return cls(tuple(parse_network(n, "--cluster-network") for n in cluster),
                   tuple(parse_network(n, "--source-allow-network") for n in allowed))

    def refusal(self, address: IPAddress) -> str | None:
        """Why ``address`` is refused (the range that holds it), or None when it may be used."""
        plain = _plain(address)
        if any(plain in net for net in self.allowed_networks if net.version == plain.version):
            return None
        for kind, networks in (("a loopback, link-local or other host-internal", ALWAYS_REFUSED),
                               ("a cluster", self.cluster_networks)):
            for net in networks:
                if net.version == plain.version and plain in net:
                    return f"{kind} range ({net})"
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
