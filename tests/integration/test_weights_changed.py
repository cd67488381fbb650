"""A weight file changed in place under a lazily loaded engine: a clear error, never SIGBUS.

Real tiny checkpoints, real files changed on disk, and the fault-in run in a child process:
a SIGBUS there shows as a signal exit (returncode -7), which the tests refuse.  The served
worker, started as a real process with every layer faulted in, holds a read lease on its files:
a truncation waits while it turns unready and exits non-zero, naming the file.
Only 127.0.0.1 is addressed; every wait is bounded in count and time.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.checkpoint import read_safetensors_header

from tests.support.procs import HOST, REPO, free_port, subprocess_env

pytestmark = pytest.mark.integration

WEIGHTS = "model.safetensors"
CHANGED_EXIT = 3  # the child caught WeightsChangedError

# Loads the engine lazily (headers, then the core only: embeddings, norm, head), changes
# the weight file as told, then faults in cold layer 0 and generates.
CHILD = r"""
import os, sys
from pathlib import Path
from warmpool_worker.checkpoint import read_safetensors_header
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.engine_api import WeightsChangedError

model, mode, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
weights = model / "model.safetensors"
engine = load_engine(model)
engine.load_layers([])
assert engine.layers_resident() == 0
if mode == "truncate":  # cut in place at layer 0's first byte: the core stays, the layers go
    header = read_safetensors_header(weights)
    first = min(t.begin for n, t in header.tensors.items() if n.startswith("model.layers."))
    with weights.open("r+b") as handle:
        handle.truncate(header.data_start + first)
elif mode == "rewrite":  # same size, other weights, written over the same inode
    with weights.open("r+b") as handle:
        handle.write(Path(other).read_bytes())
elif mode == "rename":  # the supported way: a new file renamed over the path
    os.replace(other, weights)
try:
    engine.load_layers([0])
    ids = [step.token_id for step in engine.generate([5, 6, 7], 4)]
except WeightsChangedError as error:
    print(f"WeightsChangedError: {error}", flush=True)
    sys.exit(3)
print("generated", ids, flush=True)
"""


def _run_child(model: Path, mode: str, other: Path | str = "-") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(model), mode, str(other)], env=subprocess_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=180, check=False)


def _greedy(model: Path) -> list[int]:
    from warmpool_worker.builtin.engine import load_engine

    engine = load_engine(model)
    return [step.token_id for step in engine.generate([5, 6, 7], 4)]


def test_truncated_in_place_before_a_cold_layer_is_a_clear_error_not_sigbus(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", layers=4)
    result = _run_child(model, "truncate")
    assert result.returncode == CHANGED_EXIT, f"rc {result.returncode} (-7 is SIGBUS):\n{result.stderr[-3000:]}"
    assert f"WeightsChangedError: {model / WEIGHTS}: weight file changed in place" in result.stdout
    assert "size" in result.stdout and "replace weights by rename" in result.stdout


def test_rewritten_in_place_same_size_is_refused_not_served(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", layers=4, seed=1)
    other = make_tiny_llama(tmp_path / "other", layers=4, seed=2)
    assert (other / WEIGHTS).stat().st_size == (model / WEIGHTS).stat().st_size
    result = _run_child(model, "rewrite", other / WEIGHTS)
    assert result.returncode == CHANGED_EXIT, f"rc {result.returncode}:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert f"{model / WEIGHTS}: weight file changed in place" in result.stdout and "mtime_ns" in result.stdout


def test_replaced_by_rename_keeps_serving_the_validated_weights(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", layers=4, seed=1)
    reference = shutil.copytree(model, tmp_path / "reference")
    other = make_tiny_llama(tmp_path / "other", layers=4, seed=2)
    staged = model / ".model.safetensors.new"
    shutil.copyfile(other / WEIGHTS, staged)
    result = _run_child(model, "rename", staged)
    assert result.returncode == 0, f"rc {result.returncode}:\n{result.stdout}\n{result.stderr[-3000:]}"
    # the mapping is of the validated file (held open), so the answer is the original model's
    assert f"generated {_greedy(reference)}" in result.stdout
    assert _greedy(reference) != _greedy(other)  # the check above can tell the two apart


FAULT_IN_CHILD = r"""
import sys
from pathlib import Path
from safetensors import safe_open
from warmpool_worker.builtin.engine import fault_in
from warmpool_worker.engine_api import WeightsChangedError

weights, cut = Path(sys.argv[1]), int(sys.argv[2])
tensor = safe_open(str(weights), framework="pt", device="cpu").get_tensor("lm_head.weight")
with weights.open("r+b") as handle:
    handle.truncate(cut)
try:
    fault_in(tensor)
except WeightsChangedError as error:
    print(f"WeightsChangedError: {error}", flush=True)
    sys.exit(3)
print("faulted in", flush=True)
"""


def test_fault_in_of_pages_past_a_truncation_is_an_error_not_sigbus(tmp_path: Path) -> None:
    # The window after the identity check: the file cut short between check and fault-in.
    model = make_tiny_llama(tmp_path / "tiny", layers=2, vocab_size=4096, hidden=256)
    header = read_safetensors_header(model / WEIGHTS)
    head = header.tensors["lm_head.weight"]
    assert head.nbytes >= 1 << 20  # 4 MiB: hundreds of pages past the cut below
    cut = header.data_start  # every tensor's data gone, the header kept
    result = subprocess.run([sys.executable, "-c", FAULT_IN_CHILD, str(model / WEIGHTS), str(cut)],
                            env=subprocess_env(),
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == CHANGED_EXIT, f"rc {result.returncode} (-7 is SIGBUS):\n{result.stderr[-3000:]}"
    assert "beyond the end of its file" in result.stdout


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _stream_until_eof(sock: socket.socket, limit: int = 1 << 22) -> bytes:
    received = b""
    while len(received) < limit:
        try:
            chunk = sock.recv(65536)
        except OSError:  # reset by the exiting worker: what came before is the answer
            break
        if not chunk:
            break
        received += chunk
    return received


def test_a_weight_file_truncated_after_its_layers_faulted_in_is_a_clean_exit_not_sigbus(tmp_path: Path) -> None:
    """Every layer resident (the zero-copy mapping's pages faulted in), a completion streaming,
    then the weight file is cut short in place.  Without a lease the next step reads pages the
    kernel took away: SIGBUS.  With one, the truncation waits while the worker answers the
    completion 503 naming the file, turns unready and exits 1; then the truncation goes ahead."""
    model = make_tiny_llama(tmp_path / "tiny", layers=4, max_position_embeddings=4096, with_eos=False)
    weights = model / WEIGHTS
    port = free_port()
    base = f"http://{HOST}:{port}"
    log_path = tmp_path / "worker.log"
    command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model), "--host", HOST,
               "--port", str(port), "--device", "cpu", "--buckets", "16", "--prompts-per-bucket", "1",
               "--guard-interval", "0.2", "--threads", "1", "--max-tokens-limit", "4000"]
    truncated_at: list[float] = []
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            ready = None
            for _ in range(600):  # bounded: 600 x 0.2 s
                assert proc.poll() is None, log_path.read_text(errors="replace")
                try:
                    status, body = _get(base + "/readyz")
                except OSError:
                    status, body = 0, b""
                if status == 200:
                    ready = json.loads(body)
                    break
                time.sleep(0.2)
            assert ready is not None, log_path.read_text(errors="replace")
            assert ready["layers_resident"] == 4  # every layer faulted in by the warm-up
            assert "no read lease" not in log_path.read_text(errors="replace")

            payload = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "stream": True})
            stream = socket.create_connection((HOST, port), timeout=60)
            stream.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: "
                            f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n{payload}").encode())
            head = stream.recv(65536)
            assert b"200 OK" in head, head

            header = read_safetensors_header(weights)
            first = min(t.begin for n, t in header.tensors.items() if n.startswith("model.layers."))

            def truncate() -> None:  # in place, against the runbook; held until the worker lets go
                with weights.open("r+b") as handle:
                    handle.truncate(header.data_start + first)
                truncated_at.append(time.monotonic())

            cutter = threading.Thread(target=truncate)
            cutter.start()
            answer = head + _stream_until_eof(stream)
            answered_at = time.monotonic()
            stream.close()
            returncode = proc.wait(timeout=60)
            cutter.join(timeout=60)
            assert not cutter.is_alive(), "the truncation never went ahead"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = log_path.read_text(errors="replace")
    assert returncode == 1, f"exit {returncode} (-7 is SIGBUS):\n{text[-3000:]}"
    # it waited until the worker had answered and let go (its descriptors close as it exits)
    assert truncated_at and truncated_at[0] >= answered_at
    assert f"{weights}: weight file opened for writing or truncated in place" in text
    assert "exiting for a restart" in text
    # the streaming completion was told why in-band (503's message), before the worker went
    assert b'"type": "unavailable"' in answer and str(weights).encode() in answer, answer[-2000:]
