"""`make llama-server` (warmpool_bench.llama_server_build): the command lines it runs, where it
keeps what it builds, and that a cached build does nothing.  Nothing is downloaded or compiled
here: a build that would start finds no cmake on an emptied PATH and says so."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from warmpool_bench.llama_server_build import (
    QUANTIZE,
    SERVER,
    LlamaBuildError,
    LlamaServerBuild,
    build_fraction,
    compile_command,
    configure_command,
    download_command,
    ensure_llama_server,
    installed_version,
    main,
)
from warmpool_bench.serve_servers import LLAMA_SERVER_ENV, find_llama_quantize, find_llama_server
from warmpool_dev.paths import ENV_CACHE_DIR

pytestmark = pytest.mark.unit


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty PATH (no cmake, no llama-server) and a private cache root; the root."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV_CACHE_DIR, str(root))
    return root


def test_sdist_of_the_given_version_only() -> None:
    command = download_command("0.3.36", Path("/c/sdist"))
    joined = " ".join(command)
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "--no-binary :all:" in joined  # the sdist: wheels have no vendored source
    assert "--dest /c/sdist" in joined and command[-1] == "llama_cpp_python==0.3.36"


def test_configure_is_portable_static_and_offline() -> None:
    command = configure_command(Path("/s/llama.cpp"), Path("/b"), "Ninja")
    assert command[:5] == ["cmake", "-S", "/s/llama.cpp", "-B", "/b"] and command[-2:] == ["-G", "Ninja"]
    for option in ("-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                   "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"):
        assert option in command
    assert not any("LLAMA_CURL" in part for part in command)  # deprecated and ignored by this llama.cpp
    assert "-G" not in configure_command(Path("/s"), Path("/b"), None)  # cmake's default generator


def test_compile_builds_only_the_two_targets() -> None:
    command = compile_command(Path("/b"), 2)
    assert command == ["cmake", "--build", "/b", "--target", SERVER, QUANTIZE, "--parallel", "2"]
    with pytest.raises(ValueError, match="compile jobs must be >= 1, got 0"):
        compile_command(Path("/b"), 0)


def test_progress_from_ninja_and_make_lines() -> None:
    assert build_fraction("[42/210] Building CXX object src/llama.cpp.o") == pytest.approx(0.2)
    assert build_fraction("[ 45%] Building CXX object src/llama.cpp.o") == pytest.approx(0.45)
    assert build_fraction("In file included from ggml.c:1:") is None


def test_paths_per_version(tmp_path: Path) -> None:
    build = LlamaServerBuild("0.3.36", tmp_path)
    assert build.bin_dir == tmp_path / "bin" / "llama-server-0.3.36"
    assert build.binary(SERVER) == build.bin_dir / SERVER
    assert build.work == tmp_path / "build" / "llama-server-0.3.36"
    assert build.source == build.work / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    assert LlamaServerBuild("0.3.37", tmp_path).bin_dir != build.bin_dir  # another version, another build


def test_cached_build_does_nothing(no_tools: Path) -> None:
    build = LlamaServerBuild("0.3.36", no_tools)
    for name in (SERVER, QUANTIZE):
        _executable(build.binary(name))
    assert ensure_llama_server(build) == {SERVER: build.binary(SERVER), QUANTIZE: build.binary(QUANTIZE)}
    assert not build.work.exists()  # no lock, no log, no download: nothing ran


def test_half_a_build_is_built_again(no_tools: Path) -> None:
    """llama-quantize missing: the build runs (and here stops at once: no cmake on PATH)."""
    build = LlamaServerBuild("0.3.36", no_tools)
    _executable(build.binary(SERVER))
    with pytest.raises(LlamaBuildError, match="`cmake` is not on PATH"):
        ensure_llama_server(build)


def test_main_prints_the_cached_binaries(no_tools: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = LlamaServerBuild("9.9.9", no_tools)
    for name in (SERVER, QUANTIZE):
        _executable(build.binary(name))
    assert main(["--version", "9.9.9"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{SERVER}\t{build.binary(SERVER)}",
                                                     f"{QUANTIZE}\t{build.binary(QUANTIZE)}"]
    assert main(["--version", "1.0.0"]) == 1  # not built, and no cmake to build it
    assert "`cmake` is not on PATH" in capsys.readouterr().err


def test_the_bench_finds_the_build(no_tools: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Looked up in order: $WARMPOOL_LLAMA_SERVER, `make llama-server`'s build for this venv's
    llama-cpp-python, PATH; llama-quantize beside the server."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make engine-test)")
    build = LlamaServerBuild(installed_version(), no_tools)
    on_path = _executable(tmp_path / "empty-bin" / SERVER)
    assert find_llama_server(None) == on_path
    built = _executable(build.binary(SERVER))
    assert find_llama_server(None) == built
    from_env = _executable(tmp_path / "elsewhere" / SERVER)
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(from_env))
    assert find_llama_server(None) == from_env
    with pytest.raises(FileNotFoundError, match=f"no {QUANTIZE} beside {built}"):
        find_llama_quantize(built)
    quantize = _executable(build.binary(QUANTIZE))
    assert find_llama_quantize(built) == quantize
