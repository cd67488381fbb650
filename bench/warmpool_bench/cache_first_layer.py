"""`warmpool bench cache`, part two: time to the worker's first layer, a full fill before start
against a hot-first partial fill with the worker started at once (the node cache's first-layer target).

Both variants, alternating in each round, from the same store (SeaweedFS, the revision r1 part
one pushed) into an empty cache, with the same fill order (``agent.start_order``: config and
tokenizer, the safetensors headers, the core tensors, then the layers hottest first by a heat
map the worker gets too: hottest = the *last* layer, so the order is not the file's) and the
same worker (``warmpool worker serve``, CPU, bf16 zero-copy, 1 thread, a 16-token warm-up);
optionally both read through a slower link (``--source-mib-s``: ``ThrottledSource``):

* **full**: ``fill_revision`` as today (published whole), then the worker starts on the
  published revision;
* **partial**: the fill with ``FillOptions.partial_view`` in a thread, and the worker started at
  the same moment on ``<cache>/partial/<digest>`` with ``--partial-cache``.

The clock starts when the fill starts (the node is asked for the revision); the worker's own
phase timestamps (``warmpool_coldstart_phase_timestamp_seconds``: ``first_layer_ready``,
``ready``) and one greedy completion after ready give the three times.  The target compares the
medians of first-layer times: partial / full <= 0.3, reported met or missed, never tuned to.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TARGET_FIRST_LAYER = 0.3
HOST = "127.0.0.1"
WORKER_TIMEOUT_S = 600.0
WORKER_FLAGS = ["--device", "cpu", "--dtype", "bfloat16", "--threads", "1", "--buckets", "16",
                "--prompts-per-bucket", "1", "--decode-tokens", "2"]


def _log(message: str) -> None:
    print(f"[bench cache] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _get(url: str, body: object | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def _phases(base: str) -> dict[str, float]:
    from warmpool_dev.timeline import parse_phase_metric

    from warmpool.contract.metrics import METRIC_PHASE_TIMESTAMP

    return parse_phase_metric(_get(base + "/metrics")[1].decode(), METRIC_PHASE_TIMESTAMP)


def _reversed_heat_map(model_dir: Path, path: Path) -> tuple[str, int]:
    """A heat map in which the last layer is hottest (so hot-first is not file order), written for
    the worker; its text (the fill's order reads it too) and the number of layers."""
    from warmpool_worker.checkpoint import open_checkpoint

    from warmpool.heatmap import HeatMap

    checkpoint = open_checkpoint(model_dir)
    try:
        layers = checkpoint.config.num_hidden_layers
        text = HeatMap(checkpoint.digest, layers, {i: float(i + 1) for i in range(layers)}).to_text()
    finally:
        checkpoint.close()
    path.write_text(text)
    return text, layers


class ThrottledSource:
    """A real source behind a link of `mib_s` shared by all its concurrent fetches (a slower store)."""

    def __init__(self, inner: Any, mib_s: float) -> None:
        self.inner, self.rate = inner, mib_s * 2**20
        self._lock = threading.Lock()
        self._free_at = 0.0

    def describe(self) -> str:
        return str(self.inner.describe())

    def fetch_manifest(self) -> bytes:
        data: bytes = self.inner.fetch_manifest()
        return data

    def size(self, path: str) -> int:
        return int(self.inner.size(path))

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        data: bytes = self.inner.fetch_range(path, offset, length)
        with self._lock:  # the link is busy until the bytes before these went through
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + len(data) / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))
        return data


def _order(source: Any, heat_text: str) -> tuple[Any, Any, float]:
    """The node agent's partial-start order, from the header blocks (read here, untimed, for both
    variants), and the fraction of the revision's bytes that come before the hottest layer is whole."""
    from warmpool_nodecache import agent
    from warmpool_nodecache.manifest import parse_manifest

    from warmpool.heatmap import HeatMap, layer_order

    manifest = parse_manifest(source.fetch_manifest())
    headers: dict[str, dict[str, Any]] = {}
    for ref in agent.header_blocks(manifest):
        header = agent.safetensors_header(source.fetch_range(ref.path, ref.offset, ref.length), ref.path)
        if header is not None:
            headers[ref.path] = header
    order = agent.start_order(manifest, headers, heat_text)
    heat = HeatMap.from_json(json.loads(heat_text))
    num_layers, ranges = agent.layer_ranges(headers)
    hottest = layer_order(heat.heat, num_layers)[0]
    refs = list(order(manifest))
    last = max(i for i, r in enumerate(refs) for path, start, end in ranges[hottest]
               if r.path == path and r.offset < end and start < r.offset + r.length)
    return order, manifest, sum(r.length for r in refs[:last + 1]) / manifest.total_bytes


class _Worker:
    def __init__(self, model_dir: Path, heat_map: Path, log: Path, partial: bool) -> None:
        port = _free_port()
        self.base = f"http://{HOST}:{port}"
        self.log = log
        command = [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model_dir), "--host", HOST,
                   "--port", str(port), "--heat-map", str(heat_map), *WORKER_FLAGS]
        if partial:
            command += ["--partial-cache", "--partial-cache-timeout", str(WORKER_TIMEOUT_S)]
        env = dict(os.environ)
        env.pop("POD_IP", None)  # the worker would bind it
        with log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def drive(self, t0: float) -> dict[str, float]:
        """Seconds from t0 to first layer, ready and the first greedy completion's end."""
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-1500:]}")
            with contextlib.suppress(OSError):
                if _get(self.base + "/readyz")[0] == 200:
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"worker not ready within {WORKER_TIMEOUT_S}s: {self.log}")
        status, payload = _get(self.base + "/v1/completions", {"prompt": "The cache", "max_tokens": 1,
                                                               "temperature": 0})
        done = time.time()
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {payload[:300]!r}")
        phases = _phases(self.base)
        return {"first_layer_s": phases["first_layer_ready"] - t0, "ready_s": phases["ready"] - t0,
                "first_completion_s": done - t0}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _full(source: Any, order: Any, root: Path, heat_map: Path, log: Path) -> dict[str, float]:
    from warmpool_nodecache.fill import fill_revision
    from warmpool_nodecache.layout import CacheLayout

    t0 = time.time()
    result = fill_revision(CacheLayout(root), source, order=order)
    filled = time.time() - t0
    worker = _Worker(result.path, heat_map, log, partial=False)
    try:
        return {**worker.drive(t0), "fill_s": filled}
    finally:
        worker.stop()


def _partial(source: Any, order: Any, digest_hex: str, root: Path, heat_map: Path, log: Path) -> dict[str, float]:
    from warmpool_nodecache.fill import FillOptions, fill_revision
    from warmpool_nodecache.layout import CacheLayout

    layout = CacheLayout(root)
    outcome: dict[str, Any] = {}

    def fill() -> None:
        try:
            fill_revision(layout, source, order=order, options=FillOptions(partial_view=True))
            outcome["fill_s"] = time.time() - t0
        except Exception as error:  # reported below, with the worker's own failure if any
            outcome["error"] = error

    t0 = time.time()
    thread = threading.Thread(target=fill, name="bench-partial-fill", daemon=True)
    thread.start()
    worker = _Worker(layout.partial_link(digest_hex), heat_map, log, partial=True)
    try:
        times = worker.drive(t0)
    finally:
        worker.stop()
        thread.join(timeout=WORKER_TIMEOUT_S)
    if "error" in outcome or "fill_s" not in outcome:
        raise RuntimeError(f"partial fill failed: {outcome.get('error', 'did not end')}")
    return {**times, "fill_s": float(outcome["fill_s"])}


def run_first_layer(make_source: Any, model_dir: Path, work: Path, rounds: int,
                    source_mib_s: float = 0.0) -> dict[str, Any]:
    """Both variants `rounds` times, alternating which goes first; medians and the target.
    `source_mib_s` > 0: both fills read through a link of that speed (``ThrottledSource``)."""
    heat_map = work / "heatmap.json"
    heat_text, layers = _reversed_heat_map(model_dir, heat_map)
    order, manifest, before_first = _order(make_source(), heat_text)

    def fill_source() -> Any:
        inner = make_source()
        return ThrottledSource(inner, source_mib_s) if source_mib_s > 0 else inner
    runs: dict[str, list[dict[str, float]]] = {"full": [], "partial": []}
    for round_ in range(rounds):
        variants = ["full", "partial"] if round_ % 2 == 0 else ["partial", "full"]
        for variant in variants:
            root = work / f"first-layer-{variant}-{round_}"
            shutil.rmtree(root, ignore_errors=True)
            log = work / f"first-layer-{variant}-{round_}.log"
            if variant == "full":
                runs["full"].append(_full(fill_source(), order, root, heat_map, log))
            else:
                runs["partial"].append(_partial(fill_source(), order, manifest.digest_hex, root, heat_map, log))
            shutil.rmtree(root, ignore_errors=True)
            _log(f"first layer, round {round_ + 1}, {variant}: {runs[variant][-1]['first_layer_s']:.2f}s "
                 f"(ready {runs[variant][-1]['ready_s']:.2f}s, fill {runs[variant][-1]['fill_s']:.2f}s)")
    medians = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    ratio = medians["partial"]["first_layer_s"] / medians["full"]["first_layer_s"]
    return {"runs": runs, "medians": medians, "ratio": ratio, "hottest_layer": layers - 1,
            "bytes_before_first_layer": before_first, "source_mib_s": source_mib_s or None,
            "target": {"target": f"<= {TARGET_FIRST_LAYER}x full fill", "value": ratio,
                       "met": ratio <= TARGET_FIRST_LAYER}}
