"""The node agent's guard rails that need no API server: its flags for model sources, the real
path it reports for a revision, what its failures say, and when a WarmModel's first digest is
still to be read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warmpool_nodecache import agent
from warmpool_nodecache.agent_cli import build_parser, source_settings
from warmpool_nodecache.agent_reads import revision_reported
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import ManifestError
from warmpool_nodecache.partial import point_link

pytestmark = pytest.mark.unit


def test_the_source_flags_make_the_policy_and_limits() -> None:
    parser = build_parser()
    args = parser.parse_args(["--cluster-network", "10.96.0.0/12", "--cluster-network", "10.244.0.0/16",
                              "--source-allow-network", "10.96.0.10/32", "--max-manifest-bytes", "2048",
                              "--max-block-bytes", "8192", "--source-deadline", "5"])
    policy, limits = source_settings(parser, args)
    assert [str(n) for n in policy.cluster_networks] == ["10.96.0.0/12", "10.244.0.0/16"]
    assert [str(n) for n in policy.allowed_networks] == ["10.96.0.10/32"]
    assert (limits.max_manifest_bytes, limits.max_block_bytes, limits.deadline_s) == (2048, 8192, 5.0)
    defaults = source_settings(parser, parser.parse_args([]))
    assert defaults[0].cluster_networks == () and defaults[1].deadline_s > 0


@pytest.mark.parametrize(("argv", "says"), [
    (["--cluster-network", "10.96.0.0/40"], "--cluster-network '10.96.0.0/40' is not a CIDR"),
    (["--source-allow-network", "nodes"], "--source-allow-network 'nodes' is not a CIDR"),
    (["--max-manifest-bytes", "10"], "manifest size limit must be at least 1024"),
    (["--source-deadline", "0"], "read deadline must be positive"),
    (["--manifest-reads", "0"], "--manifest-reads must be at least 1"),
])
def test_a_bad_source_flag_stops_the_agent_naming_it(argv: list[str], says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        source_settings(parser, parser.parse_args(argv))
    assert says in capsys.readouterr().err


def test_the_reported_path_is_the_real_one(tmp_path: Path) -> None:
    """The cache root reached through a link: the agent reports where the revision really lies."""
    (tmp_path / "disk" / "cache").mkdir(parents=True)
    os.symlink(tmp_path / "disk" / "cache", tmp_path / "cache")
    layout = CacheLayout(tmp_path / "cache")
    digest = "b" * 64
    real = tmp_path / "disk" / "cache"
    assert agent.revision_path(layout, digest, "ns") == str(real / "revisions" / digest)  # where it will be
    view = layout.staging / f"{digest}.1"
    view.mkdir(parents=True)
    point_link(layout.partial_link(digest, "ns"), view)  # a partial view first
    assert agent.revision_path(layout, digest, "ns") == str(tmp_path / "disk" / "cache" / "staging" / f"{digest}.1")
    layout.revision(digest).mkdir(parents=True)
    point_link(layout.granted_link(digest, "ns"), layout.revision(digest))  # published, and the namespace's
    assert agent.revision_path(layout, digest, "ns") == str(real / "revisions" / digest)


def test_a_failure_says_what_is_wrong_and_the_type_of_an_unexpected_one() -> None:
    assert agent.failure_text(ManifestError("m: not JSON")) == "m: not JSON"
    assert agent.failure_text(KeyError("x")) == "KeyError: 'x'"
    assert len(agent.failure_text(ValueError("v" * 5000))) == 1000


def test_a_first_digest_is_read_only_while_no_node_reported_one() -> None:
    entry = {"node": "n1", "source": "f" * 16}
    assert not revision_reported({"status": {"cacheNodes": [entry]}}, "f" * 16)  # a message, no revision
    reported = {"status": {"cacheNodes": [{**entry, "revision": "sha256:" + "a" * 64}]}}
    assert revision_reported(reported, "f" * 16)
    assert not revision_reported(reported, "e" * 16)  # for another source: a new first read is due
    assert not revision_reported({}, "f" * 16)
