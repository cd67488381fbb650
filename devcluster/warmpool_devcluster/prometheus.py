"""A real Prometheus for the local cluster, on 127.0.0.1, configured from the chart.

Its configuration comes from :mod:`warmpool_devcluster.prometheus_config` (the chart's
monitors as ``kubernetes_sd_configs`` jobs, the chart's rules).  Prometheus listens on
127.0.0.1 only, writes no remote storage, and keeps its TSDB under the given work dir.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from warmpool_devcluster import build, processes
from warmpool_devcluster.prometheus_config import (
    DEFAULT_SCRAPE_INTERVAL,
    PrometheusError,
    prometheus_config,
    render_monitoring,
    rule_groups,
)

__all__ = ["PrometheusError", "PrometheusHandle", "query", "running_url", "start_prometheus", "stop_recorded"]

READY_TIMEOUT_S = 60.0
#: the program name: its record in a workdir, and what a recorded pid must be running
PROGRAM = "prometheus"


@dataclass(frozen=True)
class PrometheusHandle:
    """A running Prometheus on loopback: its base URL and how to stop it."""

    url: str
    pid: int
    workdir: Path

    def stop(self) -> None:
        processes.stop_pid(self.pid)
        processes.forget(self.workdir, PROGRAM)




def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False






def start_prometheus(
    workdir: Path,
    kubeconfig: Path,
    *,
    objects: Sequence[Mapping[str, Any]] | None = None,
    scrape_interval: str = DEFAULT_SCRAPE_INTERVAL,
    port: int | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> PrometheusHandle:
    """Write the config (from ``objects``, default: the chart rendered for the dev release), start
    Prometheus on 127.0.0.1 and wait until it is ready."""
    binary = build.ensure_binaries(["prometheus"])["prometheus"]
    workdir.mkdir(parents=True, exist_ok=True)
    rendered = list(objects) if objects is not None else render_monitoring()
    rules_file = workdir / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule_groups(rendered), sort_keys=False))
    config_file = workdir / "prometheus.yaml"
    config_file.write_text(yaml.safe_dump(prometheus_config(rendered, kubeconfig, rules_file, scrape_interval),
                                          sort_keys=False))
    address = f"127.0.0.1:{port or processes.free_port()}"
    url = f"http://{address}"
    log_path = workdir / "prometheus.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [str(binary), f"--config.file={config_file}", f"--web.listen-address={address}",
             f"--storage.tsdb.path={workdir / 'data'}", "--storage.tsdb.retention.time=1d",
             f"--web.external-url={url}", "--web.enable-lifecycle"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    processes.record(workdir, PROGRAM, proc.pid, {"url": url})
    handle = PrometheusHandle(url=url, pid=proc.pid, workdir=workdir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ready(url):
            return handle
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    handle.stop()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise PrometheusError(f"Prometheus did not become ready at {url} within {timeout:.0f}s; log {log_path}:\n{tail}")








def query(url: str, expr: str, timeout: float = 10.0) -> dict[str, Any]:
    """Run an instant query; the API's whole JSON answer (status, data or error)."""
    request = urllib.request.Request(f"{url}/api/v1/query",
                                     data=urllib.parse.urlencode({"query": expr}).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:  # 400/422: a bad expression; the body says why
        answer = json.loads(error.read() or b"{}")
    return answer


def running_url(workdir: Path) -> str | None:
    """The URL of the Prometheus `start_prometheus` left running in ``workdir``, if it still runs."""
    urls = processes.recorded_urls(workdir, PROGRAM)
    return None if urls is None else urls.get("url")


def stop_recorded(workdir: Path) -> bool:
    """Stop the Prometheus recorded in ``workdir`` (by `warmpool cluster down`); True if one ran."""
    return processes.stop_recorded(workdir, PROGRAM)
