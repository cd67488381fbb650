"""Jaeger for the dev cluster: the trace store the worker and the operator export to.

The ``jaeger`` binary (v2: an OpenTelemetry Collector distribution) is built from the Go
module proxy and cached like the control plane's (`build.py`).  It runs with a config we
write, not its defaults: those listen on every interface (``:16686``, ``:4317``, pprof on
``0.0.0.0:1777``, metrics on ``:8888``...).  Ours has exactly three listeners, each on a free
port: the OTLP/HTTP receiver, the query HTTP API (and UI), and the query gRPC API (the
extension always opens one).  All are on 127.0.0.1, except that the OTLP receiver may be put
on the dev cluster node's bridge address, where workers in pods can reach it.  Traces live in
memory and go with the process.

    handle = start_jaeger(workdir)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = handle.otlp_endpoint
    ... open handle.query_url in a browser, or GET {query_url}/api/traces?service=...
    handle.stop()
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster import build, node_network, processes

#: Every Jaeger listener binds here (tests and the dev cluster talk to loopback only).
LOOPBACK = processes.LOOPBACK
#: How long Jaeger may take to answer its query API after start.
START_TIMEOUT_S = 60.0
#: the program name: its record in a workdir (`warmpool cluster up --with-observability`)
PROGRAM = "jaeger"
#: Traces kept in memory before the oldest are dropped.
MAX_TRACES = 20000


class JaegerError(RuntimeError):
    """Jaeger could not be started; the message says why and where its log is."""


@dataclass(frozen=True)
class JaegerHandle:
    """A running Jaeger: where to send traces, where to read them, and how to stop it."""

    otlp_endpoint: str  # the OTLP/HTTP base URL: the value for OTEL_EXPORTER_OTLP_ENDPOINT
    query_url: str  # the UI and the HTTP API (/api/services, /api/traces?service=...)
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        receiver = urllib.parse.urlsplit(self.otlp_endpoint)
        node_network.withdraw_from_pods(receiver.hostname or "", receiver.port or 0)




def jaeger_config(otlp_http_port: int, query_http_port: int, query_grpc_port: int,
                  otlp_address: str = LOOPBACK) -> dict[str, object]:
    """The collector config: OTLP/HTTP in, memory storage, the query API; nothing else listens."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch"],
                    "exporters": ["jaeger_storage_exporter"],
                }
            },
            # level none: no Prometheus reader for Jaeger's own metrics (its default is :8888)
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memory_store": {"memory": {"max_traces": MAX_TRACES}}}},
            "jaeger_query": {
                "storage": {"traces": "memory_store"},
                "http": {"endpoint": f"{LOOPBACK}:{query_http_port}"},
                "grpc": {"endpoint": f"{LOOPBACK}:{query_grpc_port}"},
            },
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"{otlp_address}:{otlp_http_port}"}}}},
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory_store"}},
    }


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_jaeger(workdir: Path, binary: Path | None = None, otlp_address: str = LOOPBACK) -> JaegerHandle:
    """Start Jaeger with its config and log under ``workdir``; returns once its query API answers.
    Its OTLP receiver listens on ``otlp_address`` (loopback unless told; the node's bridge address
    for workers in pods), its query API on loopback.

    The binary is built (and cached) on first use.  Raises `JaegerError` if it exits or does
    not answer within `START_TIMEOUT_S`, with the tail of its log.
    """
    jaeger = binary if binary is not None else build.ensure_binaries(["jaeger"])["jaeger"]
    workdir.mkdir(parents=True, exist_ok=True)
    otlp_port, query_port, grpc_port = processes.free_port(otlp_address), processes.free_port(), processes.free_port()
    # On the node's bridge address, the OTLP receiver is for the workers in pods: the guard lets
    # them in to that port alone.
    node_network.publish_to_pods(otlp_address, otlp_port)
    config_path = workdir / "jaeger-config.json"  # JSON is YAML: the collector reads it as such
    config_path.write_text(json.dumps(jaeger_config(otlp_port, query_port, grpc_port, otlp_address), indent=2))
    log_path = workdir / "jaeger.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [str(jaeger), f"--config=file:{config_path}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    handle = JaegerHandle(
        otlp_endpoint=f"http://{otlp_address}:{otlp_port}",
        query_url=f"http://{LOOPBACK}:{query_port}",
        process=process,
        log_path=log_path,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _answers(f"{handle.query_url}/api/services"):
            return handle
        time.sleep(0.25)
    handle.stop()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise JaegerError(f"jaeger did not answer on {handle.query_url} (exit {process.poll()}); log {log_path}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    """``python -m warmpool_devcluster.jaeger [WORKDIR]``: run Jaeger until Ctrl-C, printing its URLs."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    workdir = Path(args[0]) if args else cache_root() / "jaeger"
    try:
        handle = start_jaeger(workdir)
    except (JaegerError, build.BuildError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Jaeger UI and query API: {handle.query_url}")
    print(f"export OTEL_EXPORTER_OTLP_ENDPOINT={handle.otlp_endpoint}")
    try:
        handle.process.wait()
    except KeyboardInterrupt:
        handle.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
