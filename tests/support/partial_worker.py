"""A `warmpool worker serve` process on loopback for the partial-cache tests, and the hot-first order
split where the first layer is whole (what those tests hold back at the source)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool_nodecache import agent
from warmpool_nodecache.manifest import BlockRef, Manifest

from tests.support.procs import HOST, REPO, free_port, subprocess_env

PROMPT = "the quick brown fox"
WORKER_FLAGS = ["--device", "cpu", "--buckets", "16", "--prompts-per-bucket", "1", "--decode-tokens", "2",
                "--threads", "1", "--guard-interval", "0.5"]


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    base: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_worker(model_dir: Path, log: Path, *extra: str) -> Iterator[Worker]:
    port = free_port()
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model_dir), "--host", HOST,
               "--port", str(port), *WORKER_FLAGS, *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield Worker(proc, f"http://{HOST}:{port}", log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def until(what: str, check: Callable[[], bool], worker: Worker, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        assert worker.proc.poll() is None or what == "exit", f"worker exited waiting for {what}:\n{worker.text()}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s}s:\n{worker.text()[-4000:]}")


def ready(worker: Worker) -> bool:
    try:
        with urllib.request.urlopen(worker.base + "/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def greedy(worker: Worker) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(worker.base + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def headers_of(src: Path, block: int) -> dict[str, dict[str, Any]]:
    """The weight file's header from its first block, as the node agent reads it."""
    with (src / "model.safetensors").open("rb") as fh:
        header = agent.safetensors_header(fh.read(block), "model.safetensors")
    assert header is not None
    return {"model.safetensors": header}


def start_order_through_layer0(src: Path, manifest: Manifest, block: int) -> tuple[list[BlockRef], list[BlockRef]]:
    """The hot-first order a partial start fills in, split after the last block layer 0 needs."""
    headers = headers_of(src, block)
    refs = list(agent.start_order(manifest, headers, None)(manifest))
    _, ranges = agent.layer_ranges(headers)
    layer0 = [i for i, r in enumerate(refs) if any(
        r.path == p and r.offset < end and start < r.offset + r.length for p, start, end in ranges[0])]
    cut = max(layer0) + 1
    return refs[:cut], refs[cut:]
