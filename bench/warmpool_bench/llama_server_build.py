"""Build llama.cpp's own C++ server (``llama-server``) and ``llama-quantize`` for `warmpool bench serve`.

llama-cpp-python's wheel ships libllama, not these binaries, but its sdist on PyPI vendors all of
llama.cpp (``vendor/llama.cpp``).  So: ``pip download`` the sdist of the SAME llama-cpp-python
version this venv has (the sidecar tests' engine: one llama.cpp revision for both), unpack it under
``~/.cache/warmpool/build/llama-server-<version>/``, configure it with cmake and build only the two
targets, and keep them in ``~/.cache/warmpool/bin/llama-server-<version>/``.  Cached: a second run
finds both there and does nothing.

Bench-only (``make llama-server``): neither ``make test`` nor ``make demo`` builds it; the smoke test
skips when it is absent.  The compile is long (210 steps, about 10 minutes on 2 cores): progress
is shown from the build tool's ``[n/total]`` lines, with rich when a person watches, as plain log
lines when not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from warmpool_dev.paths import cache_root
from warmpool_devcluster.build import build_lock

#: The PyPI distribution whose sdist vendors llama.cpp.
DISTRIBUTION = "llama_cpp_python"
SERVER = "llama-server"
QUANTIZE = "llama-quantize"
TARGETS = (SERVER, QUANTIZE)
#: Compile jobs: the machine's 2 cores (more only thrash on a shared box).
DEFAULT_JOBS = 2
#: cmake's cache entries.  GGML_NATIVE=OFF: a -march=native build died of SIGILL on this machine
#: kind (the engine-test extra's note), so a portable x86-64-v3 build, as llama-cpp-python's.
#: Static, so the binaries need no libllama/libggml beside them.  No network at build or run time:
#: no prebuilt web UI download (LLAMA_USE_PREBUILT_UI fetches it from Hugging Face), no HTTPS.
#: LLAMA_CURL is not passed: this llama.cpp deprecates it and ignores it, with a warning.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CCACHE=OFF",
)
#: A build tool's progress: ninja's ``[12/210]``, or make's ``[ 45%]``.
#: Bounds: pip download and cmake configure each; the whole compile (measured: 210 steps in about
#: 10 min on 2 shared cores at load 5-10).
STEP_TIMEOUT_S = 600.0
COMPILE_TIMEOUT_S = 3 * 3600.0
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


class LlamaBuildError(RuntimeError):
    """The build could not run or failed; the message names the step and where its log is."""


def installed_version() -> str:
    """The llama-cpp-python version of this venv (the sidecar tests' engine, `make engine-test`)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise LlamaBuildError(
            f"{DISTRIBUTION} is not installed in this venv ({sys.prefix}): run `make engine-test` first, or name "
            "a version with --version") from None


@dataclass(frozen=True)
class LlamaServerBuild:
    """Where one llama-cpp-python version's llama.cpp is unpacked, built and kept."""

    version: str
    root: Path  # the warmpool cache root

    @property
    def work(self) -> Path:
        return self.root / "build" / f"llama-server-{self.version}"

    @property
    def sdist_dir(self) -> Path:
        return self.work / "sdist"

    @property
    def source(self) -> Path:
        """llama.cpp's source tree inside the unpacked sdist."""
        return self.work / "src" / f"{DISTRIBUTION}-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.work / "cmake"

    @property
    def log_path(self) -> Path:
        return self.work / "build.log"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin" / f"llama-server-{self.version}"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def is_built(self) -> bool:
        return all(_executable(self.binary(name)) for name in TARGETS)


def for_this_venv() -> LlamaServerBuild:
    return LlamaServerBuild(installed_version(), cache_root())


def cached_llama_server() -> Path | None:
    """This venv's version's llama-server if `make llama-server` built it, else None (no error)."""
    try:
        build = for_this_venv()
    except LlamaBuildError:
        return None
    binary = build.binary(SERVER)
    return binary if _executable(binary) else None


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def download_command(version: str, dest: Path) -> list[str]:
    """pip fetching the sdist only: never a wheel (it has no vendored source), never a dependency."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--progress-bar", "off",
            "--dest", str(dest), f"{DISTRIBUTION}=={version}"]


def configure_command(source: Path, build_dir: Path, generator: str | None) -> list[str]:
    command = ["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS]
    return command + (["-G", generator] if generator else [])


def compile_command(build_dir: Path, jobs: int) -> list[str]:
    """Only the two targets (and what they link), not the ~40 other tools."""
    if jobs < 1:
        raise ValueError(f"compile jobs must be >= 1, got {jobs}")
    return ["cmake", "--build", str(build_dir), "--target", *TARGETS, "--parallel", str(jobs)]


def build_fraction(line: str) -> float | None:
    """How far the build is (0..1) from one line of the build tool's output; None when it says not."""
    if step := _NINJA_STEP.match(line):
        done, total = int(step.group(1)), int(step.group(2))
        return done / total if total else None
    if percent := _MAKE_PERCENT.match(line):
        return int(percent.group(1)) / 100
    return None


def ensure_llama_server(build: LlamaServerBuild, jobs: int = DEFAULT_JOBS,
                        log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """{target: path} of the built binaries, building them first when missing (nothing when cached)."""
    say = log or _log
    if not build.is_built():
        build.work.mkdir(parents=True, exist_ok=True)
        with build_lock(build.work / "lock"):
            if not build.is_built():  # another build may have finished while we waited
                _build(build, jobs, say)
    return {name: build.binary(name) for name in TARGETS}


def _build(build: LlamaServerBuild, jobs: int, say: Callable[[str], None]) -> None:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaBuildError(f"`{tool}` is not on PATH: install cmake and a C++ compiler "
                                  "(Debian: apt-get install cmake g++)")
    started = time.monotonic()
    say(f"building {', '.join(TARGETS)} from {DISTRIBUTION} {build.version}'s vendored llama.cpp; "
        f"log: {build.log_path}")
    with build.log_path.open("a") as log_file:
        if not build.source.is_dir():
            _unpack(build, log_file, say)
        generator = "Ninja" if shutil.which("ninja") else None
        if not (build.build_dir / "CMakeCache.txt").is_file():
            say("configuring (cmake)")
            _run(configure_command(build.source, build.build_dir, generator), build, log_file, "cmake configure")
        say(f"compiling with {jobs} jobs (minutes)")
        _compile(build, jobs, log_file)
    staging = build.bin_dir.with_name(build.bin_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in TARGETS:
        shutil.copy2(build.build_dir / "bin" / name, staging / name)
    shutil.rmtree(build.bin_dir, ignore_errors=True)
    staging.rename(build.bin_dir)
    say(f"built {', '.join(TARGETS)} in {time.monotonic() - started:.0f}s: {build.bin_dir}")


def _unpack(build: LlamaServerBuild, log_file: IO[str], say: Callable[[str], None]) -> None:
    archive = build.sdist_dir / f"{DISTRIBUTION}-{build.version}.tar.gz"
    if not archive.is_file():
        say(f"downloading the {DISTRIBUTION} {build.version} sdist (pip)")
        build.sdist_dir.mkdir(parents=True, exist_ok=True)
        _run(download_command(build.version, build.sdist_dir), build, log_file, "pip download")
    if not archive.is_file():
        raise LlamaBuildError(f"pip download left no {archive.name} in {build.sdist_dir} (log: {build.log_path})")
    unpacked = build.work / "src"
    partial = build.work / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    shutil.rmtree(unpacked, ignore_errors=True)
    partial.rename(unpacked)
    if not build.source.is_dir():
        raise LlamaBuildError(f"{archive.name} has no vendor/llama.cpp (expected {build.source})")


def _run(command: list[str], build: LlamaServerBuild, log_file: IO[str], what: str) -> None:
    log_file.write(f"$ {' '.join(command)}\n")
    log_file.flush()
    result = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, timeout=STEP_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise LlamaBuildError(f"{what} failed (exit {result.returncode}); log: {build.log_path}")


def _compile(build: LlamaServerBuild, jobs: int, log_file: IO[str]) -> None:
    command = compile_command(build.build_dir, jobs)
    log_file.write(f"$ {' '.join(command)}\n")
    log_file.flush()
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        lines = _copied(proc.stdout, log_file, deadline, proc)
        if sys.stderr.isatty():
            _rich_progress(lines)
        else:
            _plain_progress(lines)
        returncode = proc.wait(timeout=60)
    if returncode != 0:
        raise LlamaBuildError(f"compiling {', '.join(TARGETS)} failed (exit {returncode}); log: {build.log_path}")


def _copied(stream: IO[str], log_file: IO[str], deadline: float, proc: subprocess.Popen[str]) -> Iterable[float]:
    """Every line into the log; the build's progress (0..1) whenever a line says it."""
    for line in stream:
        log_file.write(line)
        if time.monotonic() > deadline:
            proc.kill()
            raise LlamaBuildError(f"the compile ran past {COMPILE_TIMEOUT_S:.0f}s; log: {log_file.name}")
        if (fraction := build_fraction(line)) is not None:
            yield fraction


def _rich_progress(fractions: Iterable[float]) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("compiling llama.cpp"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task("compile", total=1.0)
        for fraction in fractions:
            progress.update(task, completed=fraction)


def _plain_progress(fractions: Iterable[float]) -> None:
    """A log line each tenth of the way (no terminal: CI, a log file)."""
    shown = -1
    for fraction in fractions:
        if int(fraction * 10) > shown:
            shown = int(fraction * 10)
            _log(f"compiling: {shown * 10}%")


def _log(message: str) -> None:
    print(f"[warmpool llama-server] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmpool_bench.llama_server_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=None,
                        help=f"the {DISTRIBUTION} version whose llama.cpp to build (default: this venv's)")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="parallel compile jobs")
    args = parser.parse_args(argv)
    try:
        build = LlamaServerBuild(args.version, cache_root()) if args.version else for_this_venv()
        paths = ensure_llama_server(build, args.jobs)
    except (LlamaBuildError, ValueError, subprocess.TimeoutExpired) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
