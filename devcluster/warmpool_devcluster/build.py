"""Build the local control plane's binaries from the Go module proxy, cached per version.

kind and k3d need a Docker engine we do not have, so we compile etcd, the Kubernetes
control plane, kubectl, kwok and helm ourselves (the envtest / kwok way).  Each binary
is cached under ``~/.cache/warmpool/bin/<name>-<version>/`` and reused; a binary found
in ``$KUBEBUILDER_ASSETS`` wins over building one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from warmpool.paths import cache_root

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.19.5"
KUBECONFORM_VERSION = "v0.7.0"

#: Binaries built from the k8s.io/kubernetes module (one wrapper go.mod for all).
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


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
)


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
    """Run a go command, streaming a heartbeat so a person sees the long build is alive."""
    if shutil.which("go") is None:
        raise BuildError("the 'go' command is not on PATH; install Go >= 1.24 to build the control plane")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("ab") as log:
        log.write(f"$ go {' '.join(args)}  (in {cwd})\n".encode())
        log.flush()
        proc = subprocess.Popen(["go", *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=_go_env())
        last_beat = started
        while proc.poll() is None:
            time.sleep(1.0)
            now = time.monotonic()
            if now - last_beat >= 30:
                _log(f"  still building {what}: {now - started:.0f}s elapsed (log: {log_path})")
                last_beat = now
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise BuildError(
            f"building {what} failed (go exit {proc.returncode}); log: {log_path}\n" + "\n".join(tail)
        )


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
    for name in names:
        out = cached_path(Binary(name, version))
        out.parent.mkdir(parents=True, exist_ok=True)
        _log(f"building {name} {version} (first build takes several minutes; cached afterwards)")
        _run_go(
            ["build", "-mod=mod", "-trimpath", "-ldflags", _version_ldflags(version), "-o", str(out),
             f"k8s.io/kubernetes/cmd/{name}"],
            workdir, log_path, f"{name} {version}",
        )


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


_GO_INSTALL_PACKAGES = {
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
    "helm": "helm.sh/helm/v3/cmd/helm",
    "kubeconform": "github.com/yannh/kubeconform/cmd/kubeconform",
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
        _run_go(["install", "-trimpath", "-ldflags", "-s -w", f"{_GO_INSTALL_PACKAGES[binary.name]}@{binary.version}"],
                workdir, log_path, f"{binary.name} {binary.version}")
    finally:
        if previous is None:
            os.environ.pop("GOBIN", None)
        else:
            os.environ["GOBIN"] = previous


def ensure_binaries(names: list[str] | None = None) -> dict[str, Path]:
    """Return {name: path} for the requested binaries, building the missing ones."""
    wanted = [b for b in ALL_BINARIES if names is None or b.name in names]
    unknown = set(names or []) - {b.name for b in ALL_BINARIES}
    if unknown:
        raise BuildError(f"unknown binaries requested: {sorted(unknown)}")
    missing = [b for b in wanted if find_binary(b) is None]
    if missing:
        started = time.monotonic()
        work = cache_root() / "build"
        log_path = cache_root() / "logs" / "build.log"
        _log(f"building {', '.join(b.name for b in missing)} from the Go module proxy; log: {log_path}")
        k8s = [b.name for b in missing if b.name in KUBERNETES_COMMANDS]
        if any(b.name == "etcd" for b in missing):
            _build_etcd(work / "etcd", log_path)
        if k8s:
            _build_kubernetes(k8s, work / "kubernetes", log_path)
        for binary in missing:
            if binary.name in _GO_INSTALL_PACKAGES:
                _go_install(binary, work / "go-install", log_path)
        _log(f"built {len(missing)} binaries in {time.monotonic() - started:.0f}s")
    found = {}
    for binary in wanted:
        path = find_binary(binary)
        if path is None:
            raise BuildError(f"{binary.name} {binary.version} is still missing after the build")
        found[binary.name] = path
    return found


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
