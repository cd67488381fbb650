"""The servers `warmpool bench serve` measures, each a real subprocess on loopback.

* ``warmpool``: ``warmpool worker serve`` on the SmolLM2 safetensors (continuous batching);
* ``llama_cpp``: llama-cpp-python's packaged OpenAI server (``python -m llama_cpp.server``, the
  ``engine-test`` extra) on the GGUF the same model ships as.  That server runs one completion
  at a time: every request waits for one lock around the model (``llama_cpp/server/app.py``),
  so it has exactly **one** slot; ``--interrupt_requests False`` makes a new request wait for
  it instead of cutting the running one short (its default);
* ``llama_server``: llama.cpp's own C++ server binary (``llama-server``), the honest peer of
  continuous batching: ``--parallel N`` slots batched together every step (``--cont-batching``),
  N matching the level's concurrency, so it is restarted per level.  llama-cpp-python ships the
  library, not the binary: ``make llama-server`` builds it from the llama.cpp its sdist vendors
  (`llama_server_build`).  The bench uses the one named by ``--llama-server``, else
  $WARMPOOL_LLAMA_SERVER, else that build, else ``llama-server`` on PATH, and reports it absent
  otherwise.

Both get the same torch/ggml thread count.  Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from warmpool_bench.llama_server_build import QUANTIZE, cached_llama_server

HOST = "127.0.0.1"
#: The packaged llama.cpp server's parallel slots (see the module docstring).
LLAMA_CPP_SLOTS = 1
#: Where the llama-server binary is looked for when --llama-server is not given (then PATH).
LLAMA_SERVER_ENV = "WARMPOOL_LLAMA_SERVER"
LLAMA_SERVER_BINARY = "llama-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    name: str
    model: str  # the name its /v1/completions wants
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    slots: int | None  # parallel requests it runs (None: bounded by its batch, see the settings)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def wait_ready(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                if self.get(path)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:g}s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("POD_IP", None)
    return env


def start_warmpool(model_dir: Path, work: Path, threads: int, max_batch: int, timeout_s: float) -> Server:
    port = free_port()
    log_path = work / "warmpool-worker.log"
    log = log_path.open("wb")
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model_dir), "--host", HOST,
               "--port", str(port), "--device", "cpu", "--dtype", "float32", "--threads", str(threads),
               "--max-batch-size", str(max_batch), "--max-queued-requests", "256",
               "--buckets", "32,128", "--prompts-per-bucket", "1"]
    proc = subprocess.Popen(command, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
    server = Server("warmpool", model_dir.name, f"http://{HOST}:{port}", proc, log_path, log, None)
    server.wait_ready("/readyz", timeout_s)
    return server


def start_llama_cpp(gguf: Path, work: Path, threads: int, context: int, timeout_s: float) -> Server:
    port = free_port()
    log_path = work / "llama-cpp-server.log"
    log = log_path.open("wb")
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST, "--port", str(port),
               "--n_ctx", str(context), "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--interrupt_requests", "False", "--model_alias", "smollm2"]
    proc = subprocess.Popen(command, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
    server = Server("llama_cpp", "smollm2", f"http://{HOST}:{port}", proc, log_path, log, LLAMA_CPP_SLOTS)
    server.wait_ready("/v1/models", timeout_s)
    return server


def find_llama_server(explicit: Path | None) -> Path:
    """The llama-server binary: `explicit`, else $WARMPOOL_LLAMA_SERVER, else `make llama-server`'s
    build for this venv's llama-cpp-python, else `llama-server` on PATH.  Raises FileNotFoundError
    naming every place looked at."""
    candidates: list[tuple[str, str | None]]
    if explicit is not None:
        candidates = [(f"--llama-server {explicit}", str(explicit))]
    else:
        from_env = os.environ.get(LLAMA_SERVER_ENV)
        built = cached_llama_server()
        candidates = [(f"${LLAMA_SERVER_ENV}={from_env}" if from_env else f"${LLAMA_SERVER_ENV} (unset)", from_env),
                      ("`make llama-server`'s build (none)" if built is None else f"{built}",
                       None if built is None else str(built)),
                      (f"{LLAMA_SERVER_BINARY} on PATH", shutil.which(LLAMA_SERVER_BINARY))]
    for _where, path in candidates:
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return Path(path)
    looked = ", ".join(where for where, _ in candidates)
    raise FileNotFoundError(
        f"no llama-server binary ({looked}): build it with `make llama-server` (from the llama.cpp that "
        "llama-cpp-python's sdist vendors), or pass --llama-server PATH")


def find_llama_quantize(server: Path) -> Path:
    """llama-quantize beside the llama-server binary (`make llama-server` builds both into one folder)."""
    quantize = server.parent / QUANTIZE
    if not (quantize.is_file() and os.access(quantize, os.X_OK)):
        raise FileNotFoundError(f"no {QUANTIZE} beside {server} (`make llama-server` builds both)")
    return quantize


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                         context_per_slot: int) -> list[str]:
    """llama-server with `parallel` slots batched together each step; its -c is the context of all
    slots together (each slot gets -c / --parallel)."""
    if parallel < 1 or context_per_slot < 1:
        raise ValueError(f"llama-server needs parallel >= 1 and a context >= 1, got {parallel}, {context_per_slot}")
    return [str(binary), "--model", str(gguf), "--host", HOST, "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * context_per_slot),
            "--alias", "smollm2"]


def start_llama_server(binary: Path, gguf: Path, work: Path, threads: int, parallel: int, context_per_slot: int,
                       timeout_s: float, name: str) -> Server:
    port = free_port()
    log_path = work / f"{name}-parallel{parallel}.log"
    log = log_path.open("wb")
    command = llama_server_command(binary, gguf, port, threads, parallel, context_per_slot)
    proc = subprocess.Popen(command, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
    server = Server(name, "smollm2", f"http://{HOST}:{port}", proc, log_path, log, parallel)
    server.wait_ready("/health", timeout_s)
    return server


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far, all its threads (Linux /proc).

    What a server's work cost in CPU, whatever share of the machine it was given: on a shared box
    its wall-clock figures move with the load, its tokens per CPU-second much less."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after "pid (comm)": state is field 3, utime 14 and stime 15 (proc(5)), here 0, 11 and 12
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_figures(server: Server) -> dict[str, float]:
    """The warmpool worker's own counters (generated tokens, busy seconds), for utilisation."""
    from prometheus_client.parser import text_string_to_metric_families

    status, payload = server.get("/metrics")
    if status != 200:
        return {}
    wanted = {"warmpool_generated_tokens_total", "warmpool_engine_busy_seconds_total", "warmpool_kv_blocks_total"}
    return {sample.name: sample.value for family in text_string_to_metric_families(payload.decode())
            for sample in family.samples if sample.name in wanted}


def describe_gguf(gguf: Path) -> dict[str, object]:
    """What llama.cpp runs: the file, its weights' quantisation (from its name) and the ggml type
    of every tensor (what the file really holds)."""
    from warmpool_bench.serve_gguf import tensor_types

    return {"path": str(gguf), "bytes": gguf.stat().st_size, "quantisation": gguf.stem.rsplit(".", 1)[-1],
            "tensor_types": tensor_types(gguf)}


def dumps(value: object) -> str:
    return json.dumps(value, indent=2)
