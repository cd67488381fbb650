"""The node agent's address policy for model sources: every cloud metadata address refused by
default, IPv6 forms judged by the IPv4 address they carry (NAT64, 6to4, Teredo, the
IPv4-compatible and -translated forms), and the cluster's own networks -- found by the agent
(``LiveNetworks``) -- refused, with every address refused until they are found.  No socket is
opened: the policy is judged on addresses alone."""

from __future__ import annotations

import ipaddress

import pytest
from warmpool_nodecache.agent_cli import build_parser, source_settings
from warmpool_nodecache.netguard import AddressPolicy, AddressRefusedError, LiveNetworks, embedded_ipv4

pytestmark = pytest.mark.unit

#: Documentation addresses (RFC 5737, 3849): outside every refused range, never connected to here.
PUBLIC_V4 = "192.0.2.7"
PUBLIC_V6 = "2001:db8::7"


def _teredo(server: str, client: str) -> str:
    """A Teredo address (RFC 4380): 2001:0::/32, the server's IPv4, flags and port, then the
    client's IPv4 with every bit flipped."""
    value = (0x2001_0000 << 96) | (int(ipaddress.IPv4Address(server)) << 64) | (
        ~int(ipaddress.IPv4Address(client)) & 0xFFFF_FFFF)
    return str(ipaddress.IPv6Address(value))


def _refusal(policy: AddressPolicy, address: str) -> str | None:
    return policy.refusal(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean (link-local)
    "fd00:ec2::254",  # AWS's IPv6 metadata service
    "fd00:ec2::253",  # ... and its IPv6 DNS resolver
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud Classic
    "168.63.129.16",  # Azure's WireServer
    "fd20:ce::254",  # GCP's IPv6 metadata service
    "::ffff:100.100.100.200",  # any of them as an IPv4-mapped address
])
def test_every_cloud_metadata_address_is_refused_by_default(address: str) -> None:
    why = _refusal(AddressPolicy(), address)
    assert why is not None and "metadata" in why, why


@pytest.mark.parametrize(("address", "carries"), [
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"),  # NAT64's well-known prefix: the gateway translates it
    ("64:ff9b::7f00:1", "127.0.0.1"),
    ("64:ff9b::6464:64c8", "100.100.100.200"),
    ("2002:a9fe:a9fe::1", "169.254.169.254"),  # 6to4: bits 16-47
    ("2002:7f00:1::", "127.0.0.1"),
    ("::7f00:1", "127.0.0.1"),  # IPv4-compatible
    ("::ffff:0:a9fe:a9fe", "169.254.169.254"),  # IPv4-translated (SIIT)
    (_teredo(PUBLIC_V4, "127.0.0.1"), "127.0.0.1"),  # Teredo's client
    (_teredo("169.254.169.254", PUBLIC_V4), "169.254.169.254"),  # ... and its server
])
def test_an_ipv6_address_is_refused_for_the_ipv4_address_it_carries(address: str, carries: str) -> None:
    assert str(ipaddress.IPv4Address(carries)) in {str(a) for a in embedded_ipv4(ipaddress.ip_address(address))}
    why = _refusal(AddressPolicy(), address)
    assert why is not None and carries in why, why


def test_the_carried_ipv4_address_meets_the_whole_policy() -> None:
    """A cluster range refuses its addresses in any IPv6 form, an allowed one allows them in any,
    a public one passes in all, and NAT64's local-use prefix is refused whole."""
    policy = AddressPolicy.from_flags(cluster=["10.96.0.0/12"], allowed=["10.96.0.10/32"])
    assert "a cluster range (10.96.0.0/12)" in str(_refusal(policy, "64:ff9b::a60:1"))  # 10.96.0.1
    assert "a cluster range" in str(_refusal(policy, "2002:a60:1::"))
    assert _refusal(policy, "64:ff9b::a60:a") is None  # 10.96.0.10, allowed
    for public in ("64:ff9b::c000:207", "2002:c000:207::1", _teredo(PUBLIC_V4, "198.51.100.9"), PUBLIC_V6):
        assert _refusal(policy, public) is None, public
    assert "64:ff9b:1::/48" in str(_refusal(policy, "64:ff9b:1:c000:2:700::"))


def test_until_the_cluster_networks_are_found_every_address_but_an_allowed_one_is_refused() -> None:
    live = LiveNetworks()
    policy = AddressPolicy.from_flags(cluster=[], allowed=["203.0.113.0/24"], discovered=live)
    assert "not found yet" in str(_refusal(policy, PUBLIC_V4))
    assert "not found yet" in str(_refusal(policy, PUBLIC_V6))
    assert _refusal(policy, "203.0.113.5") is None  # an explicit allow needs no discovery
    with pytest.raises(AddressRefusedError, match="not found yet"):
        policy.check("models.example", [PUBLIC_V4])

    live.replace([ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00:10:244::/56"),
                  ipaddress.ip_network("172.18.0.3/32")])
    for found in ("10.244.3.7", "fd00:10:244:0:1::9", "172.18.0.3", "::ffff:10.244.0.1", "64:ff9b::af4:1"):
        assert "a cluster range" in str(_refusal(policy, found)), found
    assert _refusal(policy, PUBLIC_V4) is None and _refusal(policy, "172.18.0.4") is None
    # A refresh replaces what was found: a range no longer there is no longer refused.
    live.replace([ipaddress.ip_network("10.245.0.0/16")])
    assert _refusal(policy, "10.244.3.7") is None and _refusal(policy, "10.245.0.1") is not None


def test_the_agents_flags_make_a_policy_that_finds_the_cluster_networks() -> None:
    parser = build_parser()
    policy, _ = source_settings(parser, parser.parse_args(["--cluster-network", "10.0.0.0/8"]))
    assert policy.discovered is not None and policy.discovered.networks is None  # found at start
    assert [str(n) for n in policy.cluster_networks] == ["10.0.0.0/8"]
    assert parser.parse_args([]).cluster_networks_refresh == 60.0


def test_a_refresh_interval_under_a_second_stops_the_agent(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        source_settings(parser, parser.parse_args(["--cluster-networks-refresh", "0"]))
    assert "--cluster-networks-refresh must be at least 1 second" in capsys.readouterr().err
