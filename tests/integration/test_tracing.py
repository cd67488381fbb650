"""Traces in a real Jaeger (built from the Go module proxy, loopback only), from a real worker
on a real tiny checkpoint and a real operator on the local control plane.

The last test follows a request held at zero by the activator through the operator's passes and
the cold start of the pod they start, to its first request: one trace.

Jaeger starts once for the module; each test names its own service (OTEL_SERVICE_NAME) so it
reads back only its own traces through Jaeger's HTTP API.  Every wait is bounded.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from warmpool_devcluster.jaeger import LOOPBACK, JaegerHandle, start_jaeger
from warmpool_devcluster.testing import ClusterHandle
from warmpool_worker.tracing import ENV_OTEL_SAMPLER_ARG

from tests.support.e2e import Operator, World, http, metric
from tests.support.procs import HOST, free_port, stop, subprocess_env
from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.http import CONTROL_FIELD_TRACEPARENT, PATH_METRICS, PATH_READYZ
from warmpool.contract.metrics import (
    METRIC_LAYERS_TOTAL,
    METRIC_MODEL_INFO,
    METRIC_PHASE_DURATION,
    METRIC_PHASE_TIMESTAMP,
)
from warmpool.contract.pods import ENV_POD_NAME
from warmpool.contract.telemetry import (
    ATTR_BUCKET,
    ATTR_DEVICE,
    ATTR_DIGEST,
    ATTR_LAYER,
    ATTR_POD,
    ATTR_TIER,
    ATTR_TOKENS,
    ATTR_WARMMODEL,
    ATTR_WARMMODEL_UID,
    ENV_OTEL_ENDPOINT,
    ENV_OTEL_SERVICE_NAME,
    SPAN_APPLY,
    SPAN_COLD_START,
    SPAN_DECIDE,
    SPAN_FIRST_REQUEST,
    SPAN_FORWARD,
    SPAN_HELD_REQUEST,
    SPAN_HOLD,
    SPAN_IMPORTS,
    SPAN_LAYER,
    SPAN_PREFILL,
    SPAN_READY,
    SPAN_RECONCILE,
    SPAN_STATUS,
    SPAN_TIER_APPLIED,
    SPAN_WEIGHTS_MAPPED,
)
from warmpool.contract.zero import ANNOTATION_COLD_START_TRACE

pytestmark = pytest.mark.integration

T = TypeVar("T")
Span = dict[str, Any]


@pytest.fixture(scope="module")
def jaeger(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JaegerHandle]:
    # Workers run in pods on the real node: its bridge address is where they reach this machine.
    address = cluster.node.gateway if cluster.node is not None else LOOPBACK
    handle = start_jaeger(tmp_path_factory.mktemp("jaeger"), otlp_address=address)
    try:
        yield handle
    finally:
        handle.stop()


def wait_for(check: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def traces(jaeger: JaegerHandle, service: str, operation: str | None = None) -> list[dict[str, Any]]:
    query = {"service": service, "limit": "200", "lookback": "1h"}
    if operation is not None:
        query["operation"] = operation
    url = f"{jaeger.query_url}/api/traces?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(json.load(response)["data"])


def tags(span: Span) -> dict[str, Any]:
    return {tag["key"]: tag["value"] for tag in span["tags"]}


def parent_of(span: Span) -> str | None:
    refs = [ref["spanID"] for ref in span.get("references", []) if ref["refType"] == "CHILD_OF"]
    return refs[0] if refs else None


# --------------------------------------------------------------------------- the worker's cold start


def test_worker_cold_start_is_one_trace_in_jaeger(jaeger: JaegerHandle, tiny_model: Path, tmp_path: Path) -> None:
    service = f"worker-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**subprocess_env(), ENV_OTEL_ENDPOINT: jaeger.otlp_endpoint,
           ENV_OTEL_SERVICE_NAME: service, ENV_POD_NAME: "trace-pod-0",
           ENV_OTEL_SAMPLER_ARG: "0"}  # later requests: none sampled
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(tiny_model), "--device", "cpu",
             "--host", HOST, "--port", str(port), "--buckets", "8,16", "--prompts-per-bucket", "1",
             "--decode-tokens", "2", "--log-format", "json"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{HOST}:{port}"
    try:
        wait_for(lambda: http(f"{base}{PATH_READYZ}", timeout=5)[0] == 200, 180, "the worker ready")
        for _ in range(2):  # the first joins the cold start's trace; the second is not sampled (ratio 0)
            status, _body = http(f"{base}/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == 200
        metrics_text = http(f"{base}{PATH_METRICS}")[1]

        def whole_trace() -> list[Span] | None:
            found = traces(jaeger, service)
            spans = [s for t in found for s in t["spans"]]
            return spans if any(s["operationName"] == SPAN_FIRST_REQUEST for s in spans) else None

        spans = wait_for(whole_trace, 30, "the cold start's trace (with its first request) in Jaeger")
    finally:
        worker.terminate()
        worker.wait(timeout=30)

    assert len({s["traceID"] for s in spans}) == 1, "one trace per pod start, and no sampled later request"
    roots = [s for s in spans if parent_of(s) is None]
    assert [r["operationName"] for r in roots] == [SPAN_COLD_START]
    root = roots[0]
    children = sorted((s for s in spans if s is not root), key=lambda s: (s["startTime"], s["operationName"]))
    assert all(parent_of(s) == root["spanID"] for s in children)
    layers = int(metric(metrics_text, METRIC_LAYERS_TOTAL) or 0)
    assert layers >= 1
    names = [s["operationName"] for s in children]
    assert names == [SPAN_IMPORTS, SPAN_WEIGHTS_MAPPED, *[SPAN_LAYER] * layers,
                     SPAN_PREFILL, SPAN_PREFILL, SPAN_READY, SPAN_FIRST_REQUEST]
    # the steps follow each other: each starts where the one before ended (µs, as Jaeger keeps them)
    steps = children[1:-1]
    for before, after in itertools.pairwise(steps):
        assert abs(before["startTime"] + before["duration"] - after["startTime"]) <= 1, (before, after)
    assert sorted(tags(s)[ATTR_LAYER] for s in children[2 : 2 + layers]) == list(range(layers))
    prefills = children[2 + layers : 4 + layers]
    assert [(tags(s)[ATTR_BUCKET], tags(s)[ATTR_TOKENS]) for s in prefills] == [(8, 8), (16, 16)]

    digest = next(
        line.split('digest="')[1].split('"')[0]
        for line in metrics_text.splitlines() if line.startswith(METRIC_MODEL_INFO + "{")
    )
    for span in spans:
        attributes = tags(span)
        assert attributes[ATTR_POD] == "trace-pod-0"
        assert attributes[ATTR_DIGEST] == digest
        assert attributes[ATTR_DEVICE] == "cpu"
        assert attributes[ATTR_TIER] == "full"

    # Durations agree with the phase metrics (seconds since process start; Jaeger keeps µs).
    def phase(name: str) -> float:
        value = metric(metrics_text, METRIC_PHASE_DURATION, phase=name)
        assert value is not None, name
        return value

    start = root["startTime"]
    assert abs(root["duration"] / 1e6 - phase("ready")) < 2e-6
    mapped = children[1]
    assert abs((mapped["startTime"] + mapped["duration"] - start) / 1e6 - phase("weights_mapped")) < 2e-6
    first_layer = children[2]
    assert abs((first_layer["startTime"] + first_layer["duration"] - start) / 1e6 - phase("first_layer_ready")) < 5e-3
    process_start = metric(metrics_text, METRIC_PHASE_TIMESTAMP, phase="process_start")
    assert process_start is not None and abs(process_start - start / 1e6) < 2e-6

    # --log-format json: one object per line
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("ready:") for line in lines)


# --------------------------------------------------------------------------- tracing off costs nothing

#: Runs the real `warmpool worker serve` in this interpreter (tracing off: no OTEL_* variable),
#: and once it is ready and has answered a completion and a tier directive, prints the
#: OpenTelemetry modules loaded and exits (after checking a malformed traceparent is a 400).
_PROBE = """
import json, os, sys, threading, time, urllib.error, urllib.request
from warmpool.cli import main
base, token = sys.argv[1], sys.argv[2]

def post(path, body, headers=None):
    request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status

def probe():
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        print("NOT READY", flush=True); os._exit(3)
    post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    post("/control/tier", {"tier": "truncated", "ttl_seconds": 30,
                           "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
         {"Authorization": "Bearer " + token})
    try:
        post("/control/tier", {"tier": "full", "ttl_seconds": 30, "traceparent": "not-a-traceparent"},
             {"Authorization": "Bearer " + token})
        print("BAD_TRACEPARENT=accepted", flush=True)
    except urllib.error.HTTPError as error:
        print("BAD_TRACEPARENT=" + str(error.code) + " " + error.read().decode(), flush=True)
    print("OTEL_MODULES=" + json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))), flush=True)
    os._exit(0)

threading.Thread(target=probe, daemon=True).start()
sys.exit(main(sys.argv[3:]))
"""


def test_with_tracing_off_the_worker_start_path_imports_no_opentelemetry(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("secret-token")
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, f"http://{HOST}:{port}", "secret-token",
         "worker", "serve", "--model", str(tiny_model), "--device", "cpu", "--host", HOST, "--port", str(port),
         "--buckets", "8", "--prompts-per-bucket", "1", "--decode-tokens", "2", "--log-format", "json",
         "--control-token-file", str(token_file)],
        env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    report = next(line for line in proc.stdout.splitlines() if line.startswith("OTEL_MODULES="))
    loaded = json.loads(report.split("=", 1)[1])
    assert loaded == [], f"tracing off, yet imported: {loaded}"
    # a malformed traceparent is refused, naming the field (tracing on or off)
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("BAD_TRACEPARENT="))
    assert refused.startswith("BAD_TRACEPARENT=400") and CONTROL_FIELD_TRACEPARENT in refused, refused


# --------------------------------------------------------------------------- operator -> worker


@pytest.fixture()
def traced_world(cluster: ClusterHandle, namespace: str, crd: str, jaeger: JaegerHandle, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[World, str]]:
    service = f"operator-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(ENV_OTEL_ENDPOINT, jaeger.otlp_endpoint)
    monkeypatch.setenv(ENV_OTEL_SERVICE_NAME, service)
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--log-format", "json"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    try:
        yield world, service
    finally:
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        operator.stop()
        world.close()


def test_operator_tier_change_and_worker_reaction_share_a_trace(
    traced_world: tuple[World, str], jaeger: JaegerHandle, tiny_model: Path
) -> None:
    world, operator_service = traced_world
    worker_service = f"{operator_service}-worker"
    # The worker counts its own resident memory against 4 GiB (several percent): above the
    # WarmModel's 2 % truncation line, so the operator directs the pod to "truncated".
    body = {
        "apiVersion": API_GROUP_VERSION, "kind": KIND,
        "metadata": {"name": "traced"},
        "spec": {
            "model": {"hostPath": {"path": str(tiny_model)}, "revision": "r1"},
            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2},
            "warmup": {"buckets": [8], "prompts": ["hello there"], "timeoutSeconds": 120},
            "gating": {"truncateAtPercent": 2, "pauseAtPercent": 99, "hysteresisPercent": 1},
            "pod": {
                "workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2",
                               f"--memory-capacity-bytes={4 * 1024**3}"],
                "workerEnv": [{"name": ENV_OTEL_ENDPOINT, "value": jaeger.otlp_endpoint},
                              {"name": ENV_OTEL_SERVICE_NAME, "value": worker_service}],
            },
        },
    }
    world.apply(body)
    world.wait_ready("traced", warm=1, timeout=180)

    def reaction() -> list[Span] | None:
        found = traces(jaeger, worker_service, SPAN_TIER_APPLIED)
        spans = [s for t in found for s in t["spans"]
                 if s["operationName"] == SPAN_TIER_APPLIED and tags(s)[ATTR_TIER] == "truncated"]
        return spans or None

    # (a first directive may say "full", sent before the pod's memory figure was read)
    applied = wait_for(reaction, 90, "the worker's span applying the truncated directive in Jaeger")[0]

    def shared() -> dict[str, Any] | None:
        url = f"{jaeger.query_url}/api/traces/{applied['traceID']}"
        with urllib.request.urlopen(url, timeout=10) as response:
            data = json.load(response)["data"]
        if not data:
            return None
        trace = data[0]
        services = {trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}
        return trace if {operator_service, worker_service} <= services else None

    trace = wait_for(shared, 30, "the operator's pass and the worker's reaction in one trace")
    by_id = {s["spanID"]: s for s in trace["spans"]}
    # the reaction hangs under the pass's decide span, which hangs under its reconcile span
    decide = by_id[parent_of(applied) or ""]
    assert decide["operationName"] == SPAN_DECIDE
    reconcile = by_id[parent_of(decide) or ""]
    assert reconcile["operationName"] == SPAN_RECONCILE
    wm = world.wm("traced")
    assert tags(reconcile)[ATTR_WARMMODEL_UID] == wm["metadata"]["uid"]
    names = {s["operationName"] for s in trace["spans"] if parent_of(s) == reconcile["spanID"]}
    assert {SPAN_APPLY, SPAN_DECIDE, SPAN_STATUS} <= names
    pod = world.pods("traced")[0]
    assert tags(applied)[ATTR_POD] == pod["metadata"]["name"]


# --------------------------------------------------------------------------- a request held at zero


@pytest.fixture()
def zero_traced_world(cluster: ClusterHandle, namespace: str, crd: str, jaeger: JaegerHandle, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[World, str, str]]:
    """The local operator and a local activator (`warmpool activator` on loopback), both tracing."""
    if cluster.node is None:
        pytest.skip("the pool's pods run on the local cluster's real node")
    service = f"zero-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(ENV_OTEL_ENDPOINT, jaeger.otlp_endpoint)
    monkeypatch.setenv(ENV_OTEL_SERVICE_NAME, f"{service}-operator")
    operator = Operator(cluster, namespace, tmp_path / "operator.log", installed=False,
                        extra_args=("--activator-service", f"{namespace}/activator"))
    operator.start()
    world = World(cluster, namespace, operator, diagnose_timeouts=True)
    port, health = free_port(), free_port()
    env = {**subprocess_env(), "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1",
           ENV_OTEL_ENDPOINT: jaeger.otlp_endpoint, ENV_OTEL_SERVICE_NAME: f"{service}-activator"}
    log = (tmp_path / "activator.log").open("wb")
    activator = subprocess.Popen(
        [sys.executable, "-m", "warmpool", "activator", "--namespace", namespace, "--bind", HOST,
         "--port", str(port), "--health-port", str(health), "--metrics-port", "0", "--pod-name", "trace-activator"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http(f"http://{HOST}:{health}/readyz", timeout=2)[0] == 200, 60, "the activator ready")
        yield world, service, f"http://{HOST}:{port}"
    finally:
        stop(activator, timeout=30)
        log.close()
        print("\n===== activator log (tail) =====\n" + (tmp_path / "activator.log").read_text()[-4000:])
        cluster.kubectl("-n", namespace, "delete", PLURAL, "--all", "--timeout=60s", check=False)
        operator.stop()
        world.close()


def test_a_request_held_at_zero_and_the_cold_start_it_causes_are_one_trace(
    zero_traced_world: tuple[World, str, str], jaeger: JaegerHandle, tiny_model: Path
) -> None:
    world, service, activator_url = zero_traced_world
    activator_service, operator_service, worker_service = (f"{service}-{part}" for part in
                                                           ("activator", "operator", "worker"))
    body = {
        "apiVersion": API_GROUP_VERSION, "kind": KIND,
        "metadata": {"name": "zero"},
        "spec": {
            "model": {"hostPath": {"path": str(tiny_model)}, "revision": "r1"},
            "pool": {"replicas": 1, "minWarm": 0, "maxReplicas": 2,
                     "scaleToZero": {"afterIdleSeconds": 2, "holdTimeoutSeconds": 180}},
            "warmup": {"buckets": [8], "prompts": ["hello there"], "timeoutSeconds": 120},
            "pod": {
                "workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2"],
                "workerEnv": [{"name": ENV_OTEL_ENDPOINT, "value": jaeger.otlp_endpoint},
                              {"name": ENV_OTEL_SERVICE_NAME, "value": worker_service}],
            },
        },
    }
    world.apply(body)
    # The pool starts at its size, idles (no request) and goes to zero.
    world.wait(lambda: world.get("deployment", "zero")["spec"]["replicas"] == 0 and not world.pods("zero"),
               240, "the pool at zero")
    request = urllib.request.Request(
        f"{activator_url}/v1/completions", headers={"Content-Type": "application/json", "Host": f"zero.{world.ns}"},
        data=json.dumps({"model": "zero", "prompt": "hello there", "max_tokens": 4, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=200) as response:
        assert response.status == 200
        assert json.load(response)["choices"][0]["text"]
    template = world.get("deployment", "zero")["spec"]["template"]["metadata"]["annotations"]

    def held() -> list[dict[str, Any]] | None:
        found = traces(jaeger, activator_service, SPAN_HELD_REQUEST)
        return found or None

    trace_id = wait_for(held, 30, "the activator's held request in Jaeger")[0]["traceID"]
    everything = {SPAN_HELD_REQUEST, SPAN_HOLD, SPAN_FORWARD, SPAN_RECONCILE, SPAN_APPLY, SPAN_COLD_START,
                  SPAN_READY, SPAN_FIRST_REQUEST}

    def whole() -> dict[str, Any] | None:
        with urllib.request.urlopen(f"{jaeger.query_url}/api/traces/{trace_id}", timeout=10) as answer:
            data = json.load(answer)["data"]
        return data[0] if data and everything <= {s["operationName"] for s in data[0]["spans"]} else None

    trace = wait_for(whole, 60, "the hold, the operator's passes and the pod's cold start in one trace")
    service_of = {s["spanID"]: trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}
    by_name: dict[str, list[Span]] = {}
    for span in trace["spans"]:
        by_name.setdefault(span["operationName"], []).append(span)
    (request_span,), (hold,), (forward,) = by_name[SPAN_HELD_REQUEST], by_name[SPAN_HOLD], by_name[SPAN_FORWARD]
    (cold_start,), (first,) = by_name[SPAN_COLD_START], by_name[SPAN_FIRST_REQUEST]
    assert {service_of[s["spanID"]] for s in (request_span, hold, forward)} == {activator_service}
    assert parent_of(hold) == parent_of(forward) == request_span["spanID"]
    # The operator's passes for the held request hang under the hold; one of them scaled the pool up.
    passes = by_name[SPAN_RECONCILE]
    assert passes and all(parent_of(p) == hold["spanID"] and service_of[p["spanID"]] == operator_service
                          for p in passes)
    assert tags(passes[0])[ATTR_WARMMODEL] == f"{world.ns}/zero"
    assert any(parent_of(a) in {p["spanID"] for p in passes} for a in by_name[SPAN_APPLY])
    # The pod started for it: its cold start is the hold's child, its first request the cold start's.
    assert service_of[cold_start["spanID"]] == worker_service and parent_of(cold_start) == hold["spanID"]
    assert parent_of(first) == cold_start["spanID"]
    assert tags(cold_start)[ATTR_POD] == world.pods("zero")[0]["metadata"]["name"]
    def after_hold(microseconds: int) -> str:
        return f"{(microseconds - hold['startTime']) / 1000:.0f} ms"

    first_pass = min(p["startTime"] for p in passes)
    warm = cold_start["startTime"] + cold_start["duration"]
    print(f"\ntrace {trace_id}, after the hold began: first pass {after_hold(first_pass)}, pod process "
          f"{after_hold(cold_start['startTime'])}, warm {after_hold(warm)}, "
          f"forward {after_hold(forward['startTime'])}; {len(passes)} passes in the trace")
    # request -> scale-up -> warm -> first token, in that order.
    # (Jaeger counts microseconds; the kernel's process start comes in 10 ms ticks.)
    assert hold["startTime"] <= first_pass <= cold_start["startTime"] + 20_000
    assert warm <= forward["startTime"] + 1000  # microseconds: clock rounding
    assert hold["startTime"] + hold["duration"] <= forward["startTime"] + 1000
    assert template[ANNOTATION_COLD_START_TRACE].split()[0].split("-")[1] == trace_id.rjust(32, "0")
