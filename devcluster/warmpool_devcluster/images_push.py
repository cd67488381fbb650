"""Tag the project's images for a registry and push them there (`warmpool images build --registry R --push`).

The images are built here with no registry (images.py); a cluster we did not build pulls them
from one.  Each image goes to ``<registry>/warmpool-<name>`` (the repository the chart's
``image.repository`` and ``workerImage.repository`` take) under two tags: its content tag (the
digest of its inputs, immutable: the same tag is always the same image) and the chart's
``appVersion`` (the tag the chart uses when ``image.tag`` is empty).

The push goes through the dev tools' dockerd, so it takes that Docker's rules: a registry must
speak TLS unless it is on loopback (127.0.0.0/8), and credentials come from ``docker login``.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from warmpool_devcluster import docker_engine, images

#: ``HOST[:PORT][/PATH]``: a DNS name, an IPv4 address or a bracketed IPv6 address, a port, then
#: repository path components as the OCI distribution spec allows them (lowercase).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REGISTRY = re.compile(rf"(?P<host>{_HOST})(?::(?P<port>[0-9]{{1,5}}))?(?P<path>(?:/{_PATH_COMPONENT})*)")
#: Docker Hub's names push to this host.
_DOCKER_HUB = ("docker.io", "index.docker.io")
_DOCKER_HUB_PUSH_HOST = "registry-1.docker.io"
#: How long the reachability check waits for the registry's port before any build starts.
CONNECT_TIMEOUT_S = 5.0
#: One image's push (the worker image is several GiB).
PUSH_TIMEOUT_S = 3600.0
CHART_YAML = "helm/warmpool/Chart.yaml"


class RegistryError(images.ImageError):
    """A bad registry string, or a registry that cannot be reached or refused the push."""


@dataclass(frozen=True)
class Registry:
    """A parsed ``HOST[:PORT][/PATH]``."""

    host: str
    port: int | None
    path: str  # "" or "/a/b"

    def __str__(self) -> str:
        return f"{self.host}{f':{self.port}' if self.port is not None else ''}{self.path}"

    def repository(self, name: str) -> str:
        """Where image ``name`` goes: the value for the chart's ``image.repository`` (operator)
        or ``workerImage.repository`` (worker)."""
        return f"{self}/warmpool-{name}"

    def address(self) -> tuple[str, int]:
        """Where a push connects (Docker Hub's names push to its registry host)."""
        host = _DOCKER_HUB_PUSH_HOST if self.host in _DOCKER_HUB else self.host.strip("[]")
        return host, self.port if self.port is not None else 443


def parse_registry(text: str) -> Registry:
    """``HOST[:PORT][/PATH]`` -> Registry, or RegistryError saying what is wrong with it."""
    if "://" in text:
        raise RegistryError(f"--registry {text!r}: give HOST[:PORT][/PATH] without a scheme "
                            f"(e.g. {text.split('://', 1)[1]!r}); the push uses TLS, or plain HTTP on loopback")
    found = _REGISTRY.fullmatch(text)
    if not found:
        raise RegistryError(f"--registry {text!r} is not HOST[:PORT][/PATH] (e.g. registry.example.com/team, "
                            "127.0.0.1:5000): path components are lowercase letters, digits and . _ -, "
                            "with no tag, digest or trailing slash")
    host = found["host"]
    if "." not in host and ":" not in host and not host.startswith("[") and host != "localhost" \
            and found["port"] is None:
        raise RegistryError(f"--registry {text!r}: {host!r} would be read as a Docker Hub account, not a "
                            f"registry host; for Docker Hub write docker.io/{text}")
    port = int(found["port"]) if found["port"] is not None else None
    if port is not None and not 0 < port < 65536:
        raise RegistryError(f"--registry {text!r}: port {port} is out of range")
    return Registry(host, port, found["path"])


def chart_app_version(repo: Path) -> str:
    """The chart's appVersion: the tag its image values default to."""
    chart = yaml.safe_load((repo / CHART_YAML).read_text())
    return str(chart["appVersion"])


def check_reachable(registry: Registry, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse at once, before any build, when nothing answers on the registry's port."""
    host, port = registry.address()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise RegistryError(f"the registry {registry} is unreachable ({host}:{port}: {reason}): is it running, "
                            "and is the address right?") from None


def _explain_push_failure(registry: Registry, reference: str, output: str) -> str:
    """A push's failure in one sentence that says what to do; Docker's own last line with it."""
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
    lowered = output.lower()
    if "server gave http response to https client" in lowered:
        return (f"the registry {registry} speaks plain HTTP: the image builder pushes over HTTP only to a "
                f"loopback registry (127.0.0.0/8); give it TLS ({last})")
    if any(word in lowered for word in ("denied", "unauthorized", "authentication required",
                                        "insufficient_scope", "forbidden", "unsupported", "method not allowed")):
        return (f"the registry {registry} refused the push of {reference}: {last}. Log in first "
                f"(`docker login {registry.host}{f':{registry.port}' if registry.port else ''}`) with an account "
                "that may push there, or check that the registry accepts writes")
    if any(word in lowered for word in ("connection refused", "no such host", "i/o timeout", "dial tcp",
                                        "connection reset", "network is unreachable")):
        return f"the registry {registry} is unreachable while pushing {reference}: {last}"
    return f"pushing {reference} to {registry} failed: {last}"


def _say(message: str) -> None:
    print(f"[{images.LOG_PREFIX}] {message}", file=sys.stderr, flush=True)


def _push_one(docker: docker_engine.DockerEngine, registry: Registry, reference: str) -> str:
    """Push one reference; its manifest digest."""
    proc = docker.run("push", reference, timeout=PUSH_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RegistryError(_explain_push_failure(registry, reference, output))
    digest = re.search(r"digest: (sha256:[0-9a-f]{64})", output)
    return digest.group(1) if digest else "unknown"


def tag_and_push(repo: Path, registry: Registry, names: list[str] | None, push: bool) -> dict[str, str]:
    """Build (or find built) the named images, tag each for ``registry`` and, with ``push``,
    push both its tags there; name -> the reference under its content tag."""
    if push:
        check_reachable(registry)
    app_version = chart_app_version(repo)
    with docker_engine.engine() as docker:
        built = images.build_with(docker, repo, names)
        out: dict[str, str] = {}
        for name, local in built.items():
            content_tag = local.rpartition(":")[2]
            references = [f"{registry.repository(name)}:{tag}" for tag in (content_tag, app_version)]
            for reference in references:
                tagged = docker.run("tag", local, reference)
                if tagged.returncode != 0:
                    raise images.ImageError(f"`docker tag {local} {reference}` failed: {tagged.stderr.strip()}")
            if push:
                size = docker.run("image", "inspect", "--format", "{{.Size}}", local).stdout.strip()
                size_text = f" ({int(size) / 2**30:.1f} GiB unpacked)" if size.isdigit() else ""
                for reference in references:
                    started = time.monotonic()
                    _say(f"pushing {reference}{size_text}")
                    digest = _push_one(docker, registry, reference)
                    _say(f"pushed {reference} in {time.monotonic() - started:.0f}s (manifest {digest})")
                # The registry holds them now: the engine keeps only its own names (a name is all
                # that goes; the image stays under its local tag).
                docker.run("rmi", *references)
            out[name] = references[0]
    if push:
        operator, worker = out.get("operator"), out.get("worker")
        if operator and worker:
            _say("install the chart from there: helm install warmpool helm/warmpool "
                 f"--set image.repository={registry.repository('operator')} "
                 f"--set workerImage.repository={registry.repository('worker')} "
                 f"(the tag defaults to the chart's appVersion {app_version}; pin the content tags "
                 f"--set image.tag={operator.rpartition(':')[2]} --set workerImage.tag={worker.rpartition(':')[2]})")
    return out
