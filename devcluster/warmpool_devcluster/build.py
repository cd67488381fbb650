"""Build the local control plane's binaries from the Go module proxy, cached per version.

kind and k3d need a Docker engine we do not have, so we compile etcd, the Kubernetes
control plane, kubectl, kwok and helm ourselves (the envtest / kwok way).  Each binary
is cached under ``~/.cache/warmpool/bin/<name>-<version>/`` and reused; a binary found
in ``$KUBEBUILDER_ASSETS`` wins over building one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import processes

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.19.5"
KUBECONFORM_VERSION = "v0.7.0"
#: Prometheus 3.16.0 is published to the Go module proxy as github.com/prometheus/prometheus v0.316.0.
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_RELEASE = "3.16.0"
JAEGER_VERSION = "v1.76.0"
#: SeaweedFS publishes no tagged module versions; this pseudo-version is the one the package list names.
SEAWEEDFS_VERSION = "v0.0.0-20261109003541-7506e5f91cd6"
SEAWEEDFS_MODULE = "github.com/seaweedfs/seaweedfs"
#: The CNCF image registry (distribution), for the install-from-a-registry test (registry.py).
DISTRIBUTION_VERSION = "v3.1.2"
DISTRIBUTION_MODULE = "github.com/distribution/distribution/v3"

#: Binaries built from the k8s.io/kubernetes module (one wrapper go.mod, one `go build` for all):
#: the control plane, kubectl, and the real node's kubelet and kube-proxy.
KUBERNETES_COMMANDS = (
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy",
)


class BuildError(RuntimeError):
    """A binary could not be built; the message names it and where its log is."""


@dataclass(frozen=True)
class Binary:
    name: str
    version: str


ALL_BINARIES: tuple[Binary, ...] = (
    Binary("etcd", ETCD_VERSION),
    *(Binary(name, KUBERNETES_VERSION) for name in KUBERNETES_COMMANDS),
    Binary("kwok", KWOK_VERSION),
    Binary("helm", HELM_VERSION),
    Binary("kubeconform", KUBECONFORM_VERSION),
    Binary("prometheus", PROMETHEUS_VERSION),
    Binary("promtool", PROMETHEUS_VERSION),
    Binary("jaeger", JAEGER_VERSION),
    Binary("registry", DISTRIBUTION_VERSION),
)

#: Built only when named (`warmpool cluster build --with-object-store`, or a test that needs
#: it): SeaweedFS' `weed` is a long build that a plain `make test` should not pay for.
OPTIONAL_BINARIES: tuple[Binary, ...] = (Binary("weed", SEAWEEDFS_VERSION),)

#: The binaries `--with-object-store` adds.
OBJECT_STORE_BINARIES: tuple[str, ...] = ("weed",)


def cached_path(binary: Binary) -> Path:
    return cache_root() / "bin" / f"{binary.name}-{binary.version}" / binary.name


def find_binary(binary: Binary) -> Path | None:
    """The binary from KUBEBUILDER_ASSETS if present there, else from our cache, else None."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        candidate = Path(assets) / binary.name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    path = cached_path(binary)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _log(message: str) -> None:
    print(f"[warmpool build] {message}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def _run_go(args: list[str], cwd: Path, log_path: Path, what: str) -> None:
    if shutil.which("go") is None:
        raise BuildError("the 'go' command is not on PATH; install Go >= 1.24 to build the control plane")
    try:
        processes.run_logged(["go", *args], log_path, f"building {what}", cwd=cwd, env=_go_env(),
                             prefix="warmpool build")
    except processes.CommandFailed as error:
        raise BuildError(str(error)) from None


def kubernetes_replace_lines(release_go_mod: str, version: str) -> list[str]:
    """Turn k8s.io/kubernetes' ``X => ./staging/src/X`` replaces into ``X => X v0.<minor>.<patch>``.

    The staging modules are published under v0.N.P for Kubernetes v1.N.P, so the list is
    generated from the release's own go.mod instead of being hard-coded.
    """
    staging_version = "v0." + version.removeprefix("v").split(".", 1)[1]
    lines = []
    for match in re.finditer(r"^\s*(k8s\.io/[\w.\-/]+)\s+=>\s+\./staging/src/\1\s*$", release_go_mod, re.M):
        lines.append(f"\t{match.group(1)} => {match.group(1)} {staging_version}")
    if not lines:
        raise BuildError("found no staging replace lines in k8s.io/kubernetes' go.mod; has its layout changed?")
    return lines


def _download_go_mod(module: str, version: str, workdir: Path, log_path: Path) -> str:
    _run_go(["mod", "download", f"{module}@{version}"], workdir, log_path, f"{module}@{version} (download)")
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=workdir, capture_output=True, text=True, env=_go_env(), check=True,
    )
    go_mod_path = re.search(r'"GoMod":\s*"([^"]+)"', proc.stdout)
    if go_mod_path is None:
        raise BuildError(f"go mod download gave no go.mod for {module}@{version}")
    return Path(go_mod_path.group(1)).read_text()


def _version_ldflags(version: str) -> str:
    major, minor = version.removeprefix("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return " ".join(
        [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
            "-s -w",
        ]
    )


def _build_kubernetes(names: list[str], workdir: Path, log_path: Path) -> None:
    version = KUBERNETES_VERSION
    workdir.mkdir(parents=True, exist_ok=True)
    release_go_mod = _download_go_mod("k8s.io/kubernetes", version, workdir, log_path)
    go_line = re.search(r"^go\s+(\S+)", release_go_mod, re.M)
    (workdir / "go.mod").write_text(
        "module warmpool.dev/k8s-build\n\n"
        f"go {go_line.group(1) if go_line else '1.24.0'}\n\n"
        f"require k8s.io/kubernetes {version}\n\n"
        "replace (\n" + "\n".join(kubernetes_replace_lines(release_go_mod, version)) + "\n)\n"
    )
    # -mod=mod lets the go command complete go.mod/go.sum from the release's own requirements.
    # Every command missing is built by one `go build` into a scratch folder: the shared packages
    # compile once and the links run in parallel (one build per command took minutes more).
    staging = workdir / "out"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _log(f"building {', '.join(names)} {version} in one go build (first build takes many minutes; cached afterwards)")
    _run_go(
        ["build", "-mod=mod", "-trimpath", "-ldflags", _version_ldflags(version), "-o", f"{staging}/",
         *(f"k8s.io/kubernetes/cmd/{name}" for name in names)],
        workdir, log_path, f"{', '.join(names)} {version}",
    )
    for name in names:
        out = cached_path(Binary(name, version))
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, out)


_ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

// Same entry point as etcd's own main.go; a wrapper module so the go command can resolve it.
func main() { etcdmain.Main(os.Args) }
"""


def _build_etcd(workdir: Path, log_path: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "go.mod").write_text(
        f"module warmpool.dev/etcd-build\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
    )
    (workdir / "main.go").write_text(_ETCD_MAIN)
    out = cached_path(Binary("etcd", ETCD_VERSION))
    out.parent.mkdir(parents=True, exist_ok=True)
    _log(f"building etcd {ETCD_VERSION}")
    _run_go(["build", "-mod=mod", "-trimpath", "-ldflags", "-s -w", "-o", str(out), "."],
            workdir, log_path, f"etcd {ETCD_VERSION}")


def module_replace_lines(release_go_mod: str) -> list[str]:
    """A module's own ``replace`` directives, to repeat in a wrapper module that builds it.

    ``go install pkg@version`` refuses a module whose go.mod has replace directives (jaeger
    has one), and a dependency's replaces are ignored, so the wrapper must carry them.
    """
    lines = [f"replace {m.group(1).strip()}" for m in re.finditer(r"^replace\s+([^(\n][^\n]*)$", release_go_mod, re.M)]
    for block in re.finditer(r"^replace\s*\(\n(.*?)^\)", release_go_mod, re.M | re.S):
        lines.extend(f"replace {line.strip()}" for line in block.group(1).splitlines()
                     if line.strip() and not line.strip().startswith("//"))
    return lines


def _build_jaeger(workdir: Path, log_path: Path) -> None:
    module = "github.com/jaegertracing/jaeger"
    workdir.mkdir(parents=True, exist_ok=True)
    release_go_mod = _download_go_mod(module, JAEGER_VERSION, workdir, log_path)
    go_line = re.search(r"^go\s+(\S+)", release_go_mod, re.M)
    (workdir / "go.mod").write_text(
        "module warmpool.dev/jaeger-build\n\n"
        f"go {go_line.group(1) if go_line else '1.24.0'}\n\n"
        f"require {module} {JAEGER_VERSION}\n\n"
        + "\n".join(module_replace_lines(release_go_mod)) + "\n"
    )
    out = cached_path(Binary("jaeger", JAEGER_VERSION))
    out.parent.mkdir(parents=True, exist_ok=True)
    _log(f"building jaeger {JAEGER_VERSION} (first build takes many minutes; cached afterwards)")
    _run_go(["build", "-mod=mod", "-trimpath", "-ldflags", "-s -w", "-o", str(out), f"{module}/cmd/jaeger"],
            workdir, log_path, f"jaeger {JAEGER_VERSION}")


def _build_wrapped(module: str, version: str, command: str, out_name: str, workdir: Path, log_path: Path) -> None:
    """Build ``module/command`` through a wrapper go.mod that repeats the module's replaces."""
    workdir.mkdir(parents=True, exist_ok=True)
    release_go_mod = _download_go_mod(module, version, workdir, log_path)
    go_line = re.search(r"^go\s+(\S+)", release_go_mod, re.M)
    (workdir / "go.mod").write_text(
        f"module warmpool.dev/{out_name}-build\n\n"
        f"go {go_line.group(1) if go_line else '1.24.0'}\n\n"
        f"require {module} {version}\n\n"
        + "\n".join(module_replace_lines(release_go_mod)) + "\n"
    )
    out = cached_path(Binary(out_name, version))
    out.parent.mkdir(parents=True, exist_ok=True)
    _log(f"building {out_name} {version} (first build takes many minutes; cached afterwards)")
    _run_go(["build", "-mod=mod", "-trimpath", "-ldflags", "-s -w", "-o", str(out), f"{module}/{command}"],
            workdir, log_path, f"{out_name} {version}")


_REGISTRY_MAIN = """package main

import (
\t"github.com/distribution/distribution/v3/registry"
\t_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
)

// distribution's cmd/registry with the filesystem storage driver only: its own main also links
// the S3, Azure and GCS drivers, whose SDKs more than double the build and that no test uses.
func main() { _ = registry.RootCmd.Execute() }
"""


def _build_registry(workdir: Path, log_path: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    release_go_mod = _download_go_mod(DISTRIBUTION_MODULE, DISTRIBUTION_VERSION, workdir, log_path)
    go_line = re.search(r"^go\s+(\S+)", release_go_mod, re.M)
    (workdir / "go.mod").write_text(
        "module warmpool.dev/registry-build\n\n"
        f"go {go_line.group(1) if go_line else '1.24.0'}\n\n"
        f"require {DISTRIBUTION_MODULE} {DISTRIBUTION_VERSION}\n\n"
        + "\n".join(module_replace_lines(release_go_mod)) + "\n"
    )
    (workdir / "main.go").write_text(_REGISTRY_MAIN)
    out = cached_path(Binary("registry", DISTRIBUTION_VERSION))
    out.parent.mkdir(parents=True, exist_ok=True)
    ldflags = f"-s -w -X {DISTRIBUTION_MODULE}/version.version={DISTRIBUTION_VERSION}"
    _log(f"building the image registry (distribution) {DISTRIBUTION_VERSION}")
    _run_go(["build", "-mod=mod", "-trimpath", "-ldflags", ldflags, "-o", str(out), "."],
            workdir, log_path, f"registry {DISTRIBUTION_VERSION}")


_GO_INSTALL_PACKAGES = {
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
    "helm": "helm.sh/helm/v3/cmd/helm",
    "kubeconform": "github.com/yannh/kubeconform/cmd/kubeconform",
    "prometheus": "github.com/prometheus/prometheus/cmd/prometheus",
    "promtool": "github.com/prometheus/prometheus/cmd/promtool",
}

#: Prometheus' own build tags: drop every service-discovery plugin but Kubernetes' (the only
#: one the dev cluster uses; file and http SD are always in).  Fewer packages, a shorter build.
_PROMETHEUS_TAGS = "remove_all_sd,enable_kubernetes_sd"
_PROMETHEUS_LDFLAGS = f"-X github.com/prometheus/common/version.Version={PROMETHEUS_RELEASE}"

#: Extra `go install` flags per binary (build tags, version stamps), after the common ones.
_GO_INSTALL_EXTRA: dict[str, tuple[str, str]] = {
    "prometheus": (_PROMETHEUS_TAGS, _PROMETHEUS_LDFLAGS),
    "promtool": (_PROMETHEUS_TAGS, _PROMETHEUS_LDFLAGS),
}


def _go_install(binary: Binary, workdir: Path, log_path: Path) -> None:
    out = cached_path(binary)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"building {binary.name} {binary.version}")
    env_bin = out.parent
    previous = os.environ.get("GOBIN")
    os.environ["GOBIN"] = str(env_bin)
    try:
        tags, ldflags = _GO_INSTALL_EXTRA.get(binary.name, ("", ""))
        _run_go(["install", "-trimpath", f"-tags={tags}", "-ldflags", f"-s -w {ldflags}".strip(),
                 f"{_GO_INSTALL_PACKAGES[binary.name]}@{binary.version}"],
                workdir, log_path, f"{binary.name} {binary.version}")
    finally:
        if previous is None:
            os.environ.pop("GOBIN", None)
        else:
            os.environ["GOBIN"] = previous


def ensure_binaries(names: list[str] | None = None) -> dict[str, Path]:
    """Return {name: path} for the requested binaries, building the missing ones."""
    wanted = [b for b in ALL_BINARIES if names is None or b.name in names]
    wanted += [b for b in OPTIONAL_BINARIES if names is not None and b.name in names]
    unknown = set(names or []) - {b.name for b in (*ALL_BINARIES, *OPTIONAL_BINARIES)}
    if unknown:
        raise BuildError(f"unknown binaries requested: {sorted(unknown)}")
    if any(find_binary(b) is None for b in wanted):
        with build_lock(cache_root() / "build" / "lock"):
            _build_missing(wanted)
    found = {}
    for binary in wanted:
        path = find_binary(binary)
        if path is None:
            raise BuildError(f"{binary.name} {binary.version} is still missing after the build")
        found[binary.name] = path
    return found


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """One build at a time per cache: two at once (``make -j`` targets, a test beside a build)
    share the build folders, and one would move or delete the other's outputs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another build to finish (it holds {path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_missing(wanted: list[Binary]) -> None:
    """Build what is still missing: under the lock, since another build may have made some."""
    missing = [b for b in wanted if find_binary(b) is None]
    if not missing:
        return
    started = time.monotonic()
    work = cache_root() / "build"
    log_path = cache_root() / "logs" / "build.log"
    _log(f"building {', '.join(b.name for b in missing)} from the Go module proxy; log: {log_path}")
    k8s = [b.name for b in missing if b.name in KUBERNETES_COMMANDS]
    if any(b.name == "etcd" for b in missing):
        _build_etcd(work / "etcd", log_path)
    if k8s:
        _build_kubernetes(k8s, work / "kubernetes", log_path)
    if any(b.name == "jaeger" for b in missing):
        _build_jaeger(work / "jaeger", log_path)
    if any(b.name == "registry" for b in missing):
        _build_registry(work / "registry", log_path)
    if any(b.name == "weed" for b in missing):
        # Only the `weed` command: the S3 gateway, master, volume and filer are all in it.
        _build_wrapped(SEAWEEDFS_MODULE, SEAWEEDFS_VERSION, "weed", "weed", work / "seaweedfs", log_path)
    for binary in missing:
        if binary.name in _GO_INSTALL_PACKAGES:
            _go_install(binary, work / "go-install", log_path)
    _log(f"built {len(missing)} binaries in {time.monotonic() - started:.0f}s")


def main(argv: list[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or None
    try:
        paths = ensure_binaries(names)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
