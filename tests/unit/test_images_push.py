"""`warmpool images build --registry R --push`: what a registry string may be, the names the images
get there, and the errors a person sees for a bad string, a registry that is not there, and a
push the registry refuses (the push itself, to a real registry: tests/integration/test_registry_install.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from warmpool_devcluster import images, images_cli, images_push

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "operator_repository"), [
    ("127.0.0.1:5000", "127.0.0.1:5000/warmpool-operator"),
    ("localhost:5000", "localhost:5000/warmpool-operator"),
    ("localhost", "localhost/warmpool-operator"),
    ("registry.example.com", "registry.example.com/warmpool-operator"),
    ("registry.example.com:8443/ml-platform/team_a", "registry.example.com:8443/ml-platform/team_a/warmpool-operator"),
    ("[::1]:5000", "[::1]:5000/warmpool-operator"),
    ("docker.io/acme", "docker.io/acme/warmpool-operator"),
    ("ghcr.io/acme/warmpool", "ghcr.io/acme/warmpool/warmpool-operator"),
])
def test_a_registry_names_the_repositories_the_chart_takes(text: str, operator_repository: str) -> None:
    registry = images_push.parse_registry(text)
    assert str(registry) == text
    assert registry.repository("operator") == operator_repository
    assert registry.repository("worker") == operator_repository.replace("-operator", "-worker")


@pytest.mark.parametrize(("text", "needle"), [
    ("http://127.0.0.1:5000", "without a scheme"),
    ("https://registry.example.com/team", "'registry.example.com/team'"),
    ("registry.example.com/Team", "lowercase"),
    ("registry.example.com/team/", "trailing slash"),
    ("registry.example.com/team:1.0", "no tag"),
    ("registry.example.com/team@sha256:" + "a" * 64, "HOST[:PORT][/PATH]"),
    ("", "HOST[:PORT][/PATH]"),
    ("registry.example.com:", "HOST[:PORT][/PATH]"),
    ("registry.example.com:70000", "out of range"),
    ("acme", "docker.io/acme"),
    ("acme/models", "docker.io/acme/models"),
])
def test_a_bad_registry_string_is_refused_saying_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(images_push.RegistryError) as raised:
        images_push.parse_registry(text)
    assert needle in str(raised.value), str(raised.value)
    assert repr(text) in str(raised.value)


def test_docker_hub_pushes_to_its_registry_host() -> None:
    assert images_push.parse_registry("docker.io/acme").address() == ("registry-1.docker.io", 443)
    assert images_push.parse_registry("[::1]:5000").address() == ("::1", 5000)


def closed_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: nothing listens there


def test_an_unreachable_registry_is_refused_before_any_build(capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_loopback_port()
    started = time.monotonic()
    assert images_cli.main(["build", "--registry", f"127.0.0.1:{port}", "--push"]) == 1
    err = capsys.readouterr().err
    assert f"the registry 127.0.0.1:{port} is unreachable" in err and "Connection refused" in err, err
    assert "building" not in err  # refused first: no image build, no engine started
    assert time.monotonic() - started < 10


def test_a_bad_registry_string_fails_the_command_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert images_cli.main(["build", "--registry", "http://127.0.0.1:5000", "--push"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("warmpool images build: --registry 'http://127.0.0.1:5000'") and "\n" not in err, err


def test_push_needs_a_registry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        images_cli.main(["build", "--push"])
    assert raised.value.code == 2
    assert "--push needs --registry" in capsys.readouterr().err


R = images_push.parse_registry("registry.example.com/team")
REF = "registry.example.com/team/warmpool-operator:0.1.0"


@pytest.mark.parametrize(("docker_says", "needle"), [
    # What Docker 20.10's client printed for each case (its last line is kept in the message).
    ("denied: requested access to the resource is denied", "refused the push"),
    ("unauthorized: authentication required", "docker login registry.example.com"),
    ("unknown: The operation is unsupported.", "accepts writes"),  # a read-only registry
    ("Get \"https://registry.example.com/v2/\": dial tcp 127.0.0.1:443: connect: connection refused",
     "is unreachable while pushing"),
    ("Get \"https://registry.example.com/v2/\": http: server gave HTTP response to HTTPS client",
     "speaks plain HTTP"),
    ("something else entirely", "failed: something else entirely"),
])
def test_a_failed_push_says_why(docker_says: str, needle: str) -> None:
    message = images_push._explain_push_failure(R, REF, f"The push refers to repository [{REF}]\n{docker_says}\n")
    assert needle in message and docker_says in message, message


def test_list_prints_the_local_images_as_helm_set_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """For installing the chart by hand on the dev cluster: `helm install ... $(warmpool images list --helm-set)`."""
    repo = Path(__file__).resolve().parents[2]
    assert images_cli.main(["list", "--helm-set", "--repo", str(repo)]) == 0
    line = capsys.readouterr().out.strip()
    tags = images.tags(repo)
    assert line.split() == [
        "--set", f"image.repository={tags['operator'].rpartition(':')[0]}",
        "--set", f"image.tag={tags['operator'].rpartition(':')[2]}",
        "--set", f"workerImage.repository={tags['worker'].rpartition(':')[0]}",
        "--set", f"workerImage.tag={tags['worker'].rpartition(':')[2]}",
    ]
    with pytest.raises(SystemExit):
        images_cli.main(["list", "operator", "--helm-set", "--repo", str(repo)])
    assert "--helm-set names the operator and the worker image" in capsys.readouterr().err
