"""The project's images, built on this machine with no registry (`warmpool images`, images_cli.py).

* **A base image from Debian packages** (mmdebstrap: Python 3.11, venv, libgomp1, CA bundle),
  passed to the Dockerfiles through their ``PYTHON_IMAGE`` argument, in place of a registry's
  python:slim.
* **The operator and worker images** from the project's own Dockerfiles, built by the dev tools'
  dockerd (docker_engine.py).  Their pinned wheels are fetched by the host's pip (which has the
  host's trust store and download cache) into a wheelhouse served on loopback for the build, so
  no build downloads anything itself and no certificate ever enters an image.
* **The pause image** (the pod sandbox's process) from a C file, as a one-layer image archive
  written here.

Every tag is ``warmpool.local/<name>:<digest of the image's inputs>`` (the Dockerfile, the files
its COPY lines bring, the base): an image is built once per revision of its inputs, and a
change of any input is a new tag, so a pod never runs stale code.  ``load`` imports into the real
node's containerd what it lacks; pods use ``imagePullPolicy: IfNotPresent`` and nothing ever pulls
(``warmpool.local`` resolves nowhere: a pull would fail at once instead of reaching a registry).
A cluster we did not build gets them from a registry instead: images_push.py tags and pushes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import docker_engine, node_containerd, processes

REGISTRY = "warmpool.local"
#: The base image: Debian bookworm's Python (3.11, as the Dockerfiles' default python:3.11 slim).
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "libgomp1", "ca-certificates")
BASE_PYTHON_VERSION = "3.11"
#: The wheel platforms the base (glibc 2.36) runs; pip takes the list as given, without expanding
#: a newer manylinux tag to the older ones it implies.
BASE_PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)),
                  "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
#: The wheelhouse is served here during a build: fixed, because a build argument that changes
#: would miss the layer cache of the dependency layer (the next free port is taken when busy).
WHEELHOUSE_PORT = 47311
PAUSE_SOURCE = "pause/pause.c"
LOG_PREFIX = "warmpool images"
#: Revisions of each image kept in the build engine: the newest ones, so that a cache shared by
#: two checkouts (a work tree and a CI clone) does not rebuild on every switch, while a machine
#: that builds revision after revision does not fill its disk.  The node's containerd keeps only
#: the revision it was last given (it holds each one twice, as layers and unpacked, and the engine
#: gives back an older one in about a minute).
KEEP_REVISIONS = 2
#: Free space an image build wants in the cache: the worker image from nothing is about 6 GiB in
#: the engine beside 3 GiB of wheels (a revision of the code alone needs far less, but a build
#: that runs out of space half-way leaves a broken layer cache behind, so ask before any build).
BUILD_FREE_GIB = 8


class ImageError(RuntimeError):
    """An image could not be built or loaded; the message names it and where its log is."""


@dataclass(frozen=True)
class ImageSpec:
    name: str
    dockerfile: str  # relative to the checkout's root
    requirements: str


IMAGES: dict[str, ImageSpec] = {
    "operator": ImageSpec("operator", "operator/Dockerfile", "operator/image-requirements.txt"),
    "worker": ImageSpec("worker", "worker/Dockerfile", "worker/image-requirements.txt"),
}


def _say(message: str) -> None:
    print(f"[{LOG_PREFIX}] {message}", file=sys.stderr, flush=True)


def images_dir() -> Path:
    return cache_root() / "images"


def check_checkout(repo: Path) -> Path:
    root = repo.resolve()
    missing = [spec.dockerfile for spec in IMAGES.values() if not (root / spec.dockerfile).is_file()]
    if missing:
        raise ImageError(f"{root} is not a warmpool source checkout (no {', '.join(missing)}): run from the "
                         "checkout's root or pass --repo DIR")
    return root


# --------------------------------------------------------------------------- tags


def base_tag() -> str:
    digest = hashlib.sha256(json.dumps([BASE_SUITE, sorted(BASE_PACKAGES)]).encode()).hexdigest()[:12]
    return f"{REGISTRY}/python-base:{BASE_SUITE}-{digest}"


def _copied_sources(dockerfile_text: str) -> list[str]:
    """The build-context paths a Dockerfile's COPY lines name (not COPY --from)."""
    sources: list[str] = []
    for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile_text, re.MULTILINE):
        sources += line.split()[:-1]
    return sources


def _hash_tree(digest: hashlib._Hash, root: Path, relative: str) -> None:
    path = root / relative
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if "__pycache__" in file.parts or file.suffix == ".pyc":
            continue
        digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")


def image_tag(repo: Path, name: str) -> str:
    """``warmpool.local/<name>:<digest of its inputs>`` for the checkout at ``repo``."""
    spec = IMAGES[name]
    text = (repo / spec.dockerfile).read_text()
    digest = hashlib.sha256(base_tag().encode() + b"\0" + text.encode())
    for source in _copied_sources(text):
        _hash_tree(digest, repo, source.rstrip("/"))
    return f"{REGISTRY}/{name}:{digest.hexdigest()[:16]}"


def pause_tag() -> str:
    source = resources.files(__package__).joinpath(PAUSE_SOURCE).read_bytes()
    return f"{REGISTRY}/pause:{hashlib.sha256(source).hexdigest()[:12]}"


def tags(repo: Path) -> dict[str, str]:
    """name -> tag of every image of the checkout (the pause image included)."""
    return {**{name: image_tag(repo, name) for name in IMAGES}, "pause": pause_tag()}


# --------------------------------------------------------------------------- the base image


def _ensure_base(docker: docker_engine.DockerEngine, log: Path) -> str:
    tag = base_tag()
    if docker.has_image(tag):
        return tag
    _say(f"building the base image {tag} from Debian {BASE_SUITE} packages with mmdebstrap "
         "(a few minutes, once per machine)")
    with tempfile.TemporaryDirectory(prefix="warmpool-base-") as scratch:
        archive = Path(scratch) / "base.tar"
        try:
            processes.run_logged(
                ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "--mode=root",
                 "--format=tar", BASE_SUITE, str(archive)],
                log, "making the base image's root filesystem", prefix=LOG_PREFIX)
            processes.run_logged(
                docker.argv("import", "--change", "ENV LANG=C.UTF-8", str(archive), tag),
                log, "importing the base image", env=docker.env, prefix=LOG_PREFIX)
        except processes.CommandFailed as error:
            raise ImageError(str(error)) from None
    return tag


# --------------------------------------------------------------------------- the wheelhouse


def wheelhouse_dir() -> Path:
    return images_dir() / "wheelhouse"


def _fill_wheelhouse(repo: Path, requirements: str, log: Path) -> None:
    """The pinned wheels of one requirements file, fetched by the host's pip (its cache, its trust
    store) for the base image's Python; a stamp per file's content skips it next time."""
    path = repo / requirements
    stamp = wheelhouse_dir() / ".stamps" / hashlib.sha256(path.read_bytes()).hexdigest()
    if stamp.exists():
        return
    wheelhouse_dir().mkdir(parents=True, exist_ok=True)
    _say(f"fetching the wheels {requirements} pins into {wheelhouse_dir()}")
    try:
        processes.run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "--only-binary=:all:",
             "--python-version", BASE_PYTHON_VERSION, "--implementation", "cp",
             *(f"--platform={platform}" for platform in BASE_PLATFORMS), "-r", str(path), "-d", str(wheelhouse_dir())],
            log, f"fetching the wheels of {requirements}", prefix=LOG_PREFIX)
    except processes.CommandFailed as error:
        raise ImageError(str(error)) from None
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serve_wheelhouse() -> Iterator[str]:
    """The wheelhouse over HTTP on loopback (pip's --find-links reads the directory listing)."""
    handler = lambda *a: _QuietFiles(*a, directory=str(wheelhouse_dir()))  # noqa: E731
    server: http.server.ThreadingHTTPServer | None = None
    for port in (WHEELHOUSE_PORT, 0):
        with contextlib.suppress(OSError):
            server = http.server.ThreadingHTTPServer((processes.LOOPBACK, port), handler)
            break
    if server is None:
        raise ImageError("could not serve the wheelhouse on 127.0.0.1")
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://{processes.LOOPBACK}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- build


def build(repo: Path, names: list[str] | None = None) -> dict[str, str]:
    """Build (or find built) the named images of the checkout; name -> tag.  Older revisions
    beyond ``KEEP_REVISIONS`` are removed from the engine."""
    with docker_engine.engine() as docker:
        return build_with(docker, repo, names)


def build_with(docker: docker_engine.DockerEngine, repo: Path, names: list[str] | None = None) -> dict[str, str]:
    """`build` in an engine already running (a push that follows uses the same one)."""
    repo = check_checkout(repo)
    wanted = names or list(IMAGES)
    unknown = set(wanted) - set(IMAGES)
    if unknown:
        raise ImageError(f"unknown images {sorted(unknown)}; known: {sorted(IMAGES)}")
    wanted_tags = {name: image_tag(repo, name) for name in wanted}
    todo = {name: tag for name, tag in wanted_tags.items() if not docker.has_image(tag)}
    if todo:
        _build_missing(docker, repo, todo)
    _prune_engine(docker, wanted_tags)
    return wanted_tags


def check_free_space(path: Path, need_gib: float, what: str) -> None:
    """Refuse at once, with the figures, rather than fail half-way with ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    free_gib = shutil.disk_usage(path).free / 2**30
    if free_gib < need_gib:
        raise ImageError(f"{what} needs about {need_gib:g} GiB free under {path}, and only {free_gib:.1f} GiB "
                         "is: free some space (older clusters: `warmpool cluster down --name NAME`)")


def _build_missing(docker: docker_engine.DockerEngine, repo: Path, todo: dict[str, str]) -> None:
    check_free_space(cache_root(), BUILD_FREE_GIB, f"building {', '.join(sorted(todo))}")
    log = images_dir() / "logs" / "build.log"
    base = _ensure_base(docker, log)
    for name in todo:
        _fill_wheelhouse(repo, IMAGES[name].requirements, log)
    with _serve_wheelhouse() as wheels:
        for name, tag in todo.items():
            started = time.monotonic()
            _say(f"building {tag} from {IMAGES[name].dockerfile}")
            try:
                processes.run_logged(
                    docker.argv("build", "--network", "host", "-f", IMAGES[name].dockerfile,
                                "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1",
                                "--build-arg", f"PIP_FIND_LINKS={wheels}", "-t", tag, "."),
                    log, f"building the {name} image", cwd=repo, env=docker.env, prefix=LOG_PREFIX)
            except processes.CommandFailed as error:
                raise ImageError(str(error)) from None
            _say(f"built {tag} in {time.monotonic() - started:.0f}s")


def _engine_tags(docker: docker_engine.DockerEngine, name: str) -> list[str]:
    """The engine's tags of one image, newest first (the order ``docker images`` lists)."""
    proc = docker.run("images", "--format", "{{.Repository}}:{{.Tag}}", f"{REGISTRY}/{name}")
    return [line for line in proc.stdout.split() if line.startswith(f"{REGISTRY}/{name}:")]


def stale_revisions(listed: list[str], current: str | None, keep: int = KEEP_REVISIONS) -> list[str]:
    """Of one image's tags, newest first, those beyond the newest ``keep`` (``current`` counted
    first: the revision just built or asked for is never removed)."""
    ordered = ([current] if current in listed else []) + [tag for tag in listed if tag != current]
    return ordered[keep:]


def _prune_engine(docker: docker_engine.DockerEngine, current: dict[str, str]) -> None:
    """Untag the stale revisions of each image; the engine then drops the layers no tag holds."""
    for name in IMAGES:
        stale = stale_revisions(_engine_tags(docker, name), current.get(name))
        if stale:
            proc = docker.run("rmi", *stale, timeout=600)
            if proc.returncode != 0:  # in use or already gone: never worth failing a build for
                _say(f"could not remove old images {stale}: {proc.stderr.strip()}")
            else:
                _say(f"removed {len(stale)} older revision(s) of {REGISTRY}/{name}")


# --------------------------------------------------------------------------- the pause image


def pause_archive() -> bytes:
    """The pause image as a docker-archive tarball (what ``ctr images import`` takes): one layer
    holding a static ``/pause`` compiled here from the package's C file."""
    with tempfile.TemporaryDirectory(prefix="warmpool-pause-") as scratch:
        source = Path(scratch) / "pause.c"
        source.write_bytes(resources.files(__package__).joinpath(PAUSE_SOURCE).read_bytes())
        binary = Path(scratch) / "pause"
        proc = subprocess.run(["gcc", "-static", "-O2", "-s", "-o", str(binary), str(source)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise ImageError(f"compiling the pause process failed (needs gcc and libc6-dev): {proc.stderr.strip()}")
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("pause")
            info.size, info.mode, info.mtime = binary.stat().st_size, 0o755, 0
            with binary.open("rb") as handle:
                tar.addfile(info, handle)
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [pause_tag()], "Layers": ["layer/layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("layer/layer.tar", layer_bytes), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# --------------------------------------------------------------------------- load


def load_pause(state: Path) -> str:
    """Import the pause image into the node's containerd unless it is there; its tag."""
    tag = pause_tag()
    if tag not in node_containerd.images(state):
        with tempfile.TemporaryFile() as archive:
            archive.write(pause_archive())
            archive.seek(0)
            node_containerd.ctr(state, "images", "import", "-", stdin=archive)
    return tag


def load(repo: Path, state: Path, names: list[str] | None = None) -> dict[str, str]:
    """Put the named images (built first if need be) into the real node's containerd; name -> tag."""
    if not node_containerd.answers(state):
        raise ImageError(f"no containerd answers at {node_containerd.socket_path(state)}: start the cluster with "
                         "`warmpool cluster up --node-runtime containerd` first")
    wanted = build(repo, names)
    present = node_containerd.images(state)
    missing = {name: tag for name, tag in wanted.items() if tag not in present}
    if missing:
        with docker_engine.engine() as docker:
            for tag in missing.values():
                started = time.monotonic()
                _say(f"loading {tag} into the node's containerd")
                save = subprocess.Popen(docker.argv("save", tag), env=docker.env, stdout=subprocess.PIPE)
                assert save.stdout is not None
                try:
                    node_containerd.ctr(state, "images", "import", "-", stdin=save.stdout, timeout=1800)
                finally:
                    save.stdout.close()
                    save.wait(timeout=60)
                if save.returncode != 0:
                    raise ImageError(f"`docker save {tag}` failed (exit {save.returncode})")
                _say(f"loaded {tag} in {time.monotonic() - started:.0f}s")
    if set(wanted) == set(IMAGES):  # a load of some images only leaves the others alone
        _prune_node(state, set(wanted.values()))
    return {**wanted, "pause": load_pause(state)}


def stale_node_references(digests: dict[str, str], kept: set[str]) -> set[str]:
    """The references to remove from the node's containerd (``digests``: reference -> manifest
    digest): the project's revisions not in ``kept``, and the CRI plugin's ID references
    (``sha256:...``) of those revisions, which would otherwise keep their content."""
    prefixes = tuple(f"{REGISTRY}/{name}:" for name in IMAGES)
    stale_names = {ref for ref in digests if ref.startswith(prefixes) and ref not in kept}
    held = {digest for ref, digest in digests.items() if ref not in stale_names and not ref.startswith("sha256:")}
    stale_digests = {digests[ref] for ref in stale_names} - held
    return stale_names | {ref for ref, digest in digests.items()
                          if ref.startswith("sha256:") and digest in stale_digests}


def _prune_node(state: Path, kept: set[str]) -> None:
    """Remove the stale references; ``--sync`` waits for containerd to free their content and
    unpacked snapshots.  A container still running from one keeps its snapshot until it stops."""
    stale = stale_node_references(node_containerd.image_digests(state), kept)
    if stale:
        try:
            node_containerd.ctr(state, "images", "rm", "--sync", *sorted(stale))
        except RuntimeError as error:
            _say(f"could not remove old images from the node: {error}")
        else:
            _say(f"removed {len(stale)} older image reference(s) from the node's containerd")
