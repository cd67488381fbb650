"""hostPath has a boundary: the pure check of which node directories a WarmModel may mount,
its path normalisation, the operator's --allowed-host-path flag, and agreement with the
volumes the builders really write."""

from __future__ import annotations

from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.app.cli import build_parser, main
from warmpool_operator.model import Target
from warmpool_operator.rules import builders, host_paths
from warmpool_operator.rules.host_paths import DEFAULT_ALLOWED_HOST_PATHS, BadHostPathPrefix

pytestmark = pytest.mark.unit

ALLOWED = host_paths.normalise_prefixes(DEFAULT_ALLOWED_HOST_PATHS)


def spec(model: dict[str, Any]) -> Any:
    return parse_spec({"model": model, "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2}})


@pytest.mark.parametrize(
    ("path", "normal"),
    [
        ("/models/../etc", "/etc"),
        ("/models/./llama/", "/models/llama"),
        ("/models//llama///", "/models/llama"),
        ("//etc", "/etc"),  # POSIX keeps a leading "//"; we do not
        ("/../../etc/passwd", "/etc/passwd"),  # ".." above the root stays at the root
        ("/", "/"),
    ],
)
def test_normalise(path: str, normal: str) -> None:
    assert host_paths.normalise(path) == normal


def test_a_relative_path_is_refused() -> None:
    with pytest.raises(ValueError, match="not an absolute path"):
        host_paths.normalise("models/llama")


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/models", True),
        ("/models/llama", True),
        ("/models/llama/", True),
        ("/var/lib/warmpool/models/smollm2", True),
        ("/modelsX", False),  # a string prefix, not a path prefix
        ("/models-old/llama", False),
        ("/models/../etc", False),
        ("/models/../../var/lib/kubelet", False),
        ("/var/lib/warmpool/../kubelet/pods", False),
        ("/etc", False),
        ("/var/lib/kubelet", False),
        ("/var/lib", False),  # a parent of an allowed prefix is not allowed
        ("/", False),
    ],
)
def test_paths_are_compared_by_whole_segments_after_normalising(path: str, allowed: bool) -> None:
    assert host_paths.is_allowed(path, ALLOWED) is allowed


def test_prefixes_are_normalised_deduplicated_and_absolute() -> None:
    assert host_paths.normalise_prefixes(["/models/", "/models", "//data/./m/", " /x "]) == ("/models", "/data/m", "/x")
    assert host_paths.is_allowed("/data/m/llama", host_paths.normalise_prefixes(["/data/m/"]))
    assert host_paths.is_allowed("/anything", host_paths.normalise_prefixes(["/"]))  # allowed, if unwise
    with pytest.raises(BadHostPathPrefix, match="models"):
        host_paths.normalise_prefixes(["models"])


def test_refusal_names_the_path_and_the_prefixes() -> None:
    why = host_paths.refusal(spec({"hostPath": {"path": "/etc"}}), ALLOWED)
    assert why is not None
    assert "/etc" in why and "/var/lib/warmpool" in why and "/models" in why and "--allowed-host-path" in why
    assert host_paths.refusal(spec({"hostPath": {"path": "/models/llama"}}), ALLOWED) is None


def test_node_cache_is_a_host_path_too() -> None:
    assert host_paths.refusal(spec({"nodeCache": {"key": "smollm2"}}), ALLOWED) is None  # default root
    escape = spec({"nodeCache": {"root": "/var", "key": "lib/kubelet"}})
    why = host_paths.refusal(escape, ALLOWED)
    assert why is not None and "/var/lib/kubelet" in why
    assert host_paths.refusal(spec({"pvc": {"claimName": "weights"}}), ALLOWED) is None


@pytest.mark.parametrize(
    "model",
    [{"hostPath": {"path": "/models/llama"}}, {"nodeCache": {"root": "/data/cache", "key": "m/v1"}},
     {"pvc": {"claimName": "weights"}}],
)
def test_the_check_sees_what_the_builders_mount(model: dict[str, Any]) -> None:
    target = Target(name="m", namespace="ns", spec=spec(model))
    volumes = builders.build_deployment(target)["spec"]["template"]["spec"]["volumes"]
    mounted = tuple(v["hostPath"]["path"] for v in volumes if "hostPath" in v)
    assert mounted == host_paths.mounted_host_paths(target.spec)


def test_the_flag_is_repeatable_with_a_default() -> None:
    base = ["--namespace", "ns"]
    assert build_parser().parse_args(base).allowed_host_path is None  # main() applies the default
    args = build_parser().parse_args([*base, "--allowed-host-path", "/a", "--allowed-host-path=/b/"])
    assert args.allowed_host_path == ["/a", "/b/"]


def test_a_relative_flag_stops_the_operator_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namespace", "ns", "--allowed-host-path", "models"]) == 2
    err = capsys.readouterr().err
    assert "--allowed-host-path" in err and "'models' is not an absolute path" in err


def test_the_real_paths_the_node_agents_report_are_checked_too() -> None:
    """A link in the cache's path on a node (the agent reports where a revision really lies) cannot
    lead a mount out of the allowed directories: the WarmModel is refused, naming the node."""
    from warmpool_operator.rules.object_store_pods import reported_paths

    from warmpool import cachekeys

    source = {"http": {"url": "http://models.example/m"}}
    wm = spec(source)
    fingerprint = cachekeys.source_fingerprint(source)
    inside = {"node": "n1", "source": fingerprint, "path": "/var/lib/warmpool/cache/revisions/" + "a" * 64}
    outside = {"node": "n2", "source": fingerprint, "path": "/etc/kubernetes/pki"}
    older = {"node": "n3", "source": "0" * 16, "path": "/etc"}  # another source's entry: not this mount
    status = {"cacheNodes": [inside, outside, older, {"node": "n4", "source": fingerprint}]}
    reported = reported_paths(wm, status)
    assert reported == [("n1", inside["path"]), ("n2", "/etc/kubernetes/pki")]
    why = host_paths.refusal(wm, ALLOWED, reported=reported)
    assert why is not None and "/etc/kubernetes/pki (the real path on node n2)" in why and "n1" not in why
    assert host_paths.refusal(wm, ALLOWED, reported=reported[:1]) is None


@pytest.mark.parametrize(
    "model",
    [{"hostPath": {"path": "/var/lib/warmpool/cache"}}, {"hostPath": {"path": "/var/lib/warmpool/cache/revisions"}},
     {"hostPath": {"path": "/var/lib/warmpool"}},
     {"nodeCache": {"root": "/var/lib/warmpool", "key": "cache"}}],
)
def test_the_block_cache_is_never_a_warmmodels_own_host_path(model: dict[str, Any]) -> None:
    """The default prefixes allow /var/lib/warmpool, which holds the node's block cache (every
    tenant's models): a WarmModel naming the cache, a directory in it, or one holding it is refused."""
    why = host_paths.refusal(spec(model), ALLOWED)
    assert why is not None and "would mount the node's block cache (/var/lib/warmpool/cache)" in why, why
    assert "no pod is created" in why


def test_beside_the_block_cache_a_host_path_is_allowed_and_a_moved_cache_moves_the_boundary() -> None:
    assert host_paths.refusal(spec({"hostPath": {"path": "/var/lib/warmpool/cachex"}}), ALLOWED) is None
    assert host_paths.refusal(spec({"nodeCache": {"key": "smollm2"}}), ALLOWED) is None  # /var/lib/warmpool/models
    moved = host_paths.refusal(spec({"hostPath": {"path": "/var/lib/warmpool/cache"}}), ALLOWED, "/data/blocks")
    assert moved is None
    assert host_paths.refusal(spec({"hostPath": {"path": "/data"}}), (*ALLOWED, "/data"), "/data/blocks") is not None
