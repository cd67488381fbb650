"""The dashboard's, the alerts' and the runbooks' PromQL, run against a real Prometheus.

One live pool for the module: the chart installed into the local cluster (the operator runs
as a pod on the local cluster's real node), a WarmModel of a tiny real model gone warm with demand
prediction in shadow mode (``spec.pool.predictive.enabled: false``: it forecasts and reports
without acting, on a short history step), completions served until the operator has measured a
pod's capacity, and a real Prometheus 3 (built from the Go module proxy) discovering the
operator and the worker pods through Kubernetes service discovery with the chart's own
monitor relabelling (warmpool_devcluster.prometheus) and evaluating the chart's own rules.
Every expression (tests/support/promql.py says where they come from and how each is judged)
must parse, run, and return data, or be listed there with the reason it cannot.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from warmpool_devcluster import build, prometheus, prometheus_config
from warmpool_devcluster.chart_values import local_values
from warmpool_devcluster.node_network import SERVICE_CIDR, on_a_node_bridge
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.rules.forecast import report as forecast_report
from warmpool_operator.rules.forecast.steps import MIN_BUSY_SECONDS, MIN_SERVED
from warmpool_operator.rules.zero import activator_slice_name

from tests.support import promql
from tests.support.e2e import http, metric, model_root, tiny_model, warmmodel
from warmpool.contract.api import CONDITION_PREDICTIVE, PLURAL
from warmpool.contract.http import DEFAULT_WORKER_PORT, PATH_METRICS
from warmpool.contract.metrics import (
    FORECAST_QUANTILE_P50,
    FORECAST_QUANTILE_P90,
    METRIC_ENGINE_BUSY_SECONDS,
    METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD,
    METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS,
    METRIC_OPERATOR_FORECAST_PEAK,
    METRIC_OPERATOR_FORECAST_RATE_NOW,
    METRIC_OPERATOR_WARM_PODS,
    METRIC_READY,
    METRIC_REQUEST_PROMPT_TOKENS,
    METRIC_REQUESTS_TOTAL,
    METRIC_TTFT,
    NODE_AGENT_STAGE_MANIFEST,
)
from warmpool.contract.pods import LABEL_MODEL, WORKER_CONTAINER
from warmpool.contract.zero import ERROR_HOLD_TIMEOUT, LABEL_SERVICE_NAME

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "warmpool"
DASHBOARD = CHART / "files" / "dashboards" / "warmpool.json"
RUNBOOKS = REPO / "docs" / "runbooks"
RELEASE = "wpprom"
SCRAPE_INTERVAL = "2s"
#: Bounds on the waits (the pool warms in well under a minute on 2 cores).
WARM_TIMEOUT_S = 180.0
SERIES_TIMEOUT_S = 90.0
DATA_TIMEOUT_S = 60.0
#: Demand prediction's history step: the default 60 s would leave no forecast within the waits above;
#: 4 s holds two of the operator's 2 s scrapes, so no step goes unobserved.
PREDICT_STEP_S = 4
#: Completions sent (one at a time, loopback) until the worker's own counters show the work the operator's
#: capacity meter needs (MIN_SERVED requests, MIN_BUSY_SECONDS of busy engine), twice over: bounded in count.
CAPACITY_MAX_REQUESTS = 400
CAPACITY_CHECK_EVERY = 5
CAPACITY_MARGIN = 2.0
#: From there, the bound on the operator's measurement: a step (PREDICT_STEP_S), a scrape and a pass, many times over.
CAPACITY_TIMEOUT_S = 60.0
#: The alerts' durations and windows shortened through the chart's values (defaults unchanged), so each
#: one this module drives fires within seconds of the state it names.
FAST_ALERTS = (
    "metrics.prometheusRule.belowMinWarmFor=4s",
    "metrics.prometheusRule.operatorDownFor=4s",
    "metrics.prometheusRule.degradedFor=4s",
    "metrics.prometheusRule.reconcileErrorsWindow=1m",
    "metrics.prometheusRule.reconcileErrorsThreshold=3",
    "metrics.prometheusRule.reconcileErrorsFor=4s",
    "metrics.prometheusRule.activatorRefusedWindow=1m",
    "metrics.prometheusRule.activatorRefusedFor=2s",
    "metrics.prometheusRule.nodeAgentFillFailuresWindow=1m",
    "metrics.prometheusRule.nodeAgentFillFailuresThreshold=0",
    "metrics.prometheusRule.nodeAgentFillFailuresFor=4s",
)
#: The node agent's cache root (the chart's default); the operator may mount it (an http-sourced pool's pods would).
NODE_CACHE_ROOT = "/var/lib/warmpool/cache"
#: Every alert the chart ships (this module's install runs the activator and the node agent).
ALERTS = ("WarmpoolPoolBelowMinWarm", "WarmpoolTierPaused", "WarmpoolColdStartSlow", "WarmpoolWorkerScrapeDown",
          "WarmpoolOperatorScrapeFailures", "WarmpoolOperatorDown", "WarmpoolModelDegraded", "WarmpoolReconcileErrors",
          "WarmpoolActivatorRefusing", "WarmpoolNodeAgentFillFailures")
#: Bound on the wait for an alert driven into its state to fire (its `for:` above, a few scrapes and
#: evaluations, and the operator's or the agent's pass).
FIRE_TIMEOUT_S = 90.0
#: The operator's per-WarmModel forecast series (status.forecast's figures) for this module's WarmModel.
FORECAST_SERIES = (
    f'{METRIC_OPERATOR_FORECAST_RATE_NOW}{{warmmodel="tiny"}}',
    f'{METRIC_OPERATOR_FORECAST_PEAK}{{warmmodel="tiny", quantile="{FORECAST_QUANTILE_P50}"}}',
    f'{METRIC_OPERATOR_FORECAST_PEAK}{{warmmodel="tiny", quantile="{FORECAST_QUANTILE_P90}"}}',
    f'{METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD}{{warmmodel="tiny"}}',
    f'{METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS}{{warmmodel="tiny"}}',
)


def _helm(cluster: ClusterHandle, *args: str) -> None:
    binary = str(build.ensure_binaries(["helm"])["helm"])
    proc = subprocess.run([binary, "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def _wait_for(what: str, probe: Any, timeout: float, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def _api(url: str, path: str, **params: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}{path}?{urllib.parse.urlencode(params)}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:
        answer = json.loads(error.read() or b"{}")
    return answer


def _series(url: str, expr: str) -> list[dict[str, Any]]:
    answer = prometheus.query(url, expr)
    assert answer.get("status") == "success", f"{expr}: {answer}"
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def _operator_pods(cluster: ClusterHandle) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
    pods: list[dict[str, Any]] = json.loads(cluster.kubectl(
        "get", "pods", "-n", _NAMESPACE, "-l", selector, "-o", "json").stdout)["items"]
    return pods


def _add_operator_arg(cluster: ClusterHandle, arg: str) -> None:
    """Add a flag the chart has no value for (a test-only setting) to the installed operator, and
    wait for the rollout: the old pod gone and a pod of the new one holding the leader Lease (a
    pod is Ready as a standby, before it holds the Lease)."""
    deployment = f"deployment/{RELEASE}-warmpool"
    patch = [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": arg}]
    cluster.kubectl("patch", "-n", _NAMESPACE, deployment, "--type=json", "-p", json.dumps(patch))
    cluster.kubectl("rollout", "status", "-n", _NAMESPACE, deployment, "--timeout=180s", timeout=200)

    def new_pod_leads() -> bool:
        pods = _operator_pods(cluster)
        lease = json.loads(cluster.kubectl("get", "lease", f"{RELEASE}-warmpool", "-n", _NAMESPACE, "-o", "json",
                                           check=False).stdout or "{}")
        holder = str((lease.get("spec") or {}).get("holderIdentity") or "")
        acting = [p for p in pods if holder.startswith(p["metadata"]["name"] + "-")]
        return len(pods) == 1 and bool(acting) and arg in acting[0]["spec"]["containers"][0]["args"]

    _wait_for(f"the operator pod with {arg} alone, holding the leader Lease", new_pod_leads, 90.0)


def _worker_work(metrics_url: str) -> tuple[float, float]:
    """The worker's own count of what its capacity is measured from: (requests served, busy engine seconds)."""
    code, text = http(metrics_url)
    assert code == 200, text
    served = metric(text, METRIC_REQUEST_PROMPT_TOKENS + "_count")
    busy = metric(text, METRIC_ENGINE_BUSY_SECONDS)
    assert served is not None and busy is not None, f"the worker exports no served or busy counter:\n{text}"
    return served, busy


def _serve_until_capacity_measured(cluster: ClusterHandle, url: str, worker: str) -> None:
    """Completions, one at a time, until the worker has done the work the operator's capacity meter needs
    (read from the worker itself, not guessed from a clock); then the operator's own measurement
    (status.forecast.capacityPerPod), then its gauge in Prometheus.  A failure names the stage."""
    served0, busy0 = _worker_work(worker + PATH_METRICS)
    served = busy = 0.0
    sent = 0
    while served < CAPACITY_MARGIN * MIN_SERVED or busy < CAPACITY_MARGIN * MIN_BUSY_SECONDS:
        if sent >= CAPACITY_MAX_REQUESTS:
            raise AssertionError(f"{sent} completions served {served:g} requests in {busy:.2f} busy seconds, short "
                                 f"of {CAPACITY_MARGIN:g} x ({MIN_SERVED:g}, {MIN_BUSY_SECONDS:g} s)\n"
                                 f"{_capacity_diagnosis(cluster, url)}")
        for _ in range(CAPACITY_CHECK_EVERY):
            code, text = http(worker + "/v1/completions",
                              {"model": "tiny", "prompt": "hello there, how are you", "max_tokens": 16})
            assert code == 200, text
            sent += 1
        now_served, now_busy = _worker_work(worker + PATH_METRICS)
        served, busy = now_served - served0, now_busy - busy0
    try:
        _wait_for("the operator's measured capacity per pod in status.forecast",
                  lambda: (_status(cluster).get("forecast") or {}).get("capacityPerPod"), CAPACITY_TIMEOUT_S, 1.0)
        _wait_for("the operator's measured capacity per pod in Prometheus",
                  lambda: _series(url, f'{METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD}{{warmmodel="tiny"}}'),
                  SERIES_TIMEOUT_S, 2.0)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{sent} completions sent: the worker served {served:g} in {busy:.2f} busy "
                             f"seconds\n{_capacity_diagnosis(cluster, url)}") from None


def _status(cluster: ClusterHandle) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(cluster.kubectl("get", PLURAL, "tiny", "-n", _NAMESPACE,
                                                     "-o", "json").stdout).get("status") or {}
    return got


def _capacity_diagnosis(cluster: ClusterHandle, url: str) -> str:
    """What the operator and the worker said while the capacity never showed (a failure's report)."""
    status = cluster.kubectl("get", PLURAL, "tiny", "-n", _NAMESPACE, "-o", "jsonpath={.status}", check=False)
    logs = cluster.kubectl("logs", "-n", _NAMESPACE, f"deployment/{RELEASE}-warmpool", "--tail=80", check=False)
    busy = _series(url, f'{METRIC_ENGINE_BUSY_SECONDS}{{warmmodel="tiny"}}')
    served = _series(url, f'{METRIC_REQUESTS_TOTAL}{{warmmodel="tiny"}}')
    # A restarted operator starts its counters' baselines again: the served burst before it is not measured.
    restarts = [(p["metadata"]["name"], [(c.get("restartCount"), c.get("lastState")) for c in
                                         p["status"].get("containerStatuses") or []]) for p in _operator_pods(cluster)]
    return (f"the WarmModel's status: {status.stdout}\nthe worker's busy seconds in Prometheus: {busy}\n"
            f"its requests: {served}\nthe operator's pods (restarts, last state): {restarts}\n"
            f"the operator's last log lines:\n{logs.stdout}{logs.stderr}")


#: This module's namespace: the release's and the WarmModel's (the chart renders for it).
_NAMESPACE = f"t-promql-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """The chart's Service, monitors and rules, rendered for this module's release."""
    return prometheus_config.render_monitoring(RELEASE, _NAMESPACE, [f"watch.namespaces[0]={_NAMESPACE}",
                                                                     "nodeAgent.enabled=true", *FAST_ALERTS])


@pytest.fixture(scope="module")
def live_pool(cluster: ClusterHandle, crd: str, tmp_path_factory: pytest.TempPathFactory,
              rendered: list[dict[str, Any]]) -> Iterator[str]:
    """A real Prometheus scraping the chart's operator and a warm WarmModel; its URL."""
    cluster.kubectl("create", "namespace", _NAMESPACE)
    work = tmp_path_factory.mktemp("prometheus")
    assert cluster.node is not None, "the chart's operator runs in a pod on the local cluster's real node"
    values = local_values(cluster.images, cluster.node.pod_cidr)
    values |= {
        "crds": {"install": False},
        "watch": {"namespaces": [_NAMESPACE]},
        "operator": {**values["operator"], "replicas": 1, "scrapeInterval": 2,
                     "allowedHostPaths": [str(model_root()), NODE_CACHE_ROOT]},
        # The node agent, for its failed-fill alert: a pass every 2 s, so a failing read repeats.
        "nodeAgent": {**values.get("nodeAgent", {}), "enabled": True, "interval": 2, "cacheRoot": NODE_CACHE_ROOT},
        "probes": {"readiness": {"initialDelaySeconds": 1, "periodSeconds": 2, "timeoutSeconds": 5,
                                 "failureThreshold": 3}},
    }
    values_file = work / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    handle: prometheus.PrometheusHandle | None = None
    try:
        _helm(cluster, "install", RELEASE, str(CHART), "-n", _NAMESPACE, "-f", str(values_file),
              "--wait", "--timeout", "180s")
        _add_operator_arg(cluster, f"--predict-step-seconds={PREDICT_STEP_S}")
        handle = prometheus.start_prometheus(work, cluster.kubeconfig, objects=rendered,
                                             scrape_interval=SCRAPE_INTERVAL)
        obj = warmmodel("tiny", tiny_model(layers=2, name="tiny-llama-2l"))
        obj["spec"]["pool"]["predictive"] = {"enabled": False}  # shadow: forecast and report, never act
        cluster.kubectl("apply", "-n", _NAMESPACE, "-f", "-", input=yaml.safe_dump(obj))
        url = handle.url

        def warm() -> bool:
            got = _series(url, f'{METRIC_OPERATOR_WARM_PODS}{{warmmodel="tiny"}} >= 1')
            return bool(got)

        _wait_for("the operator to report the pool warm through Prometheus", warm, WARM_TIMEOUT_S, 2.0)
        # One served completion, so the time-to-first-token histogram has an observation.
        pods = json.loads(cluster.kubectl("get", "pods", "-n", _NAMESPACE, "-l",
                                          f"{LABEL_MODEL}=tiny", "-o", "json").stdout)["items"]
        ip = pods[0]["status"]["podIP"]
        assert on_a_node_bridge(ip), f"tests only talk to loopback and the local node's pods, got pod IP {ip}"
        worker = f"http://{ip}:{DEFAULT_WORKER_PORT}"
        code, text = http(worker + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert code == 200, text
        # Enough served work for the operator to measure a pod's capacity: the forecast panel's warm capacity.
        _serve_until_capacity_measured(cluster, url, worker)

        def ttft_rate_seen() -> bool:
            return bool(_series(url, f"sum(rate({METRIC_TTFT}_count[5m])) > 0"))

        _wait_for("two scrapes after the completion", ttft_rate_seen, SERIES_TIMEOUT_S)
        yield url
    finally:
        if handle is not None:
            handle.stop()
        subprocess.run([str(build.ensure_binaries(["helm"])["helm"]), "--kubeconfig", str(cluster.kubeconfig),
                        "uninstall", RELEASE, "-n", _NAMESPACE, "--wait", "--timeout", "60s"],
                       capture_output=True, timeout=120)
        cluster.kubectl("delete", "namespace", _NAMESPACE, "--wait=false", "--ignore-not-found", check=False)


def test_promtool_checks_the_charts_rules_and_the_scrape_config(rendered: list[dict[str, Any]],
                                                                tmp_path: Path) -> None:
    promtool = str(build.ensure_binaries(["promtool"])["promtool"])
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(prometheus_config.rule_groups(rendered), sort_keys=False))
    checked = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    alerts = [e for e in promql.rule_expressions(o for o in rendered if o["kind"] == "PrometheusRule")]
    assert f"SUCCESS: {len(alerts)} rules found" in checked.stdout, checked.stdout
    assert {e.where for e in alerts} == {f"alert: {name}" for name in ALERTS}
    # Every alert links a runbook page that exists.
    for obj in rendered:
        for group in obj["spec"]["groups"] if obj["kind"] == "PrometheusRule" else []:
            for rule in group["rules"]:
                page = rule["annotations"]["runbook_url"].rsplit("/", 1)[1]
                assert (RUNBOOKS / page).is_file(), f"{rule['alert']} links {page}, which docs/runbooks lacks"
    config = tmp_path / "prometheus.yaml"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    config.write_text(yaml.safe_dump(prometheus_config.prometheus_config(rendered, kubeconfig, rules)))
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_prometheus_discovers_the_operator_and_the_workers(live_pool: str) -> None:
    targets = _api(live_pool, "/api/v1/targets", state="active")["data"]["activeTargets"]
    up = {(t["labels"]["job"], t["labels"]["container"]): t for t in targets if t["health"] == "up"}
    assert (f"{RELEASE}-warmpool-metrics", "operator") in up, targets
    assert (f"{_NAMESPACE}/{RELEASE}-warmpool-workers", WORKER_CONTAINER) in up, targets
    for target in targets:  # only the local node's pod IPs are ever scraped
        assert on_a_node_bridge(target["labels"]["instance"].rsplit(":", 1)[0]), target
    # The PodMonitor's relabelling: the WarmModel's name and the node are labels of the series.
    (ready,) = _series(live_pool, f'{METRIC_READY}{{warmmodel="tiny"}}')
    assert ready["metric"]["namespace"] == _NAMESPACE and ready["metric"]["node"], ready
    # honorLabels on the operator's ServiceMonitor: its namespace label is the WarmModel's.
    (warm,) = _series(live_pool, f'{METRIC_OPERATOR_WARM_PODS}{{warmmodel="tiny"}}')
    assert warm["metric"]["namespace"] == _NAMESPACE and "exported_namespace" not in warm["metric"], warm
    # Shadow-mode demand prediction exports status.forecast's figures, under the same labels.
    for selector in FORECAST_SERIES:
        series = _wait_for(f"{selector} in Prometheus", lambda s=selector: _series(live_pool, s), DATA_TIMEOUT_S, 2.0)
        assert [s["metric"]["namespace"] for s in series] == [_NAMESPACE], series


def test_the_forecast_series_mirror_status_forecast(live_pool: str, cluster: ClusterHandle) -> None:
    """The panel's figures are the WarmModel's status.forecast, from a shadow-mode forecast on the
    test's history step (the flag reached the operator), in the same units."""
    forecast = _status(cluster)["forecast"]
    assert forecast["stepSeconds"] == PREDICT_STEP_S, forecast
    (predictive,) = [c for c in _status(cluster)["conditions"] if c["type"] == CONDITION_PREDICTIVE]
    assert predictive["reason"] == forecast_report.REASON_SHADOW, predictive

    def same_capacity() -> tuple[float, float] | None:
        # Capacity changes only on steps that served requests (none now): status and the gauge settle equal.
        (series,) = _series(live_pool, f'{METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD}{{warmmodel="tiny"}}')
        figures = (float(series["value"][1]), float(_status(cluster)["forecast"]["capacityPerPod"]))
        return figures if figures[0] == figures[1] else None

    capacity, _ = _wait_for("the capacity gauge to equal status.forecast.capacityPerPod", same_capacity,
                            DATA_TIMEOUT_S, 2.0)
    assert capacity > 0


def _all_expressions(rendered: list[dict[str, Any]]) -> list[promql.Expression]:
    return [
        *promql.dashboard_expressions(json.loads(DASHBOARD.read_text())),
        *promql.rule_expressions(o for o in rendered if o["kind"] == "PrometheusRule"),
        *promql.runbook_expressions(RUNBOOKS),
    ]


def _data_within(url: str, expr: str, timeout: float) -> bool:
    """The expression returns data within ``timeout`` (bounded): a rate() needs two scrapes of
    its series, and a series an operator pass first writes may be a scrape or two behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _series(url, expr):
            return True
        time.sleep(2.0)
    return False


def test_every_shipped_promql_expression_runs_and_returns_data(live_pool: str,
                                                              rendered: list[dict[str, Any]]) -> None:
    expressions = _all_expressions(rendered)
    # Each source contributes: a dashboard, the alerts and the runbooks' blocks.
    assert sum(e.where.startswith("dashboard") for e in expressions) >= 20
    assert sum(e.is_alert for e in expressions) == len(ALERTS)
    assert sum(e.where.startswith("runbook") for e in expressions) >= 10
    assert not set(promql.NEEDS) - {e.where for e in expressions}, "NEEDS names an expression that is gone"
    problems = []
    for expression in expressions:
        parsed = _api(live_pool, "/api/v1/parse_query", query=expression.expr)
        if parsed.get("status") != "success":
            problems.append(f"{expression.where}: does not parse: {parsed.get('error')}")
            continue
        answer = prometheus.query(live_pool, expression.expr)
        if answer.get("status") != "success":
            problems.append(f"{expression.where}: query failed: {answer.get('error')}")
            continue
        if expression.where in promql.NEEDS:
            continue
        quiet = set()
        for selector in promql.selectors(parsed["data"]):
            name = promql.quiet_metric(selector)
            if name is not None:
                quiet.add(name)
            elif not _series(live_pool, selector):
                problems.append(f"{expression.where}: reads {selector}, which has no series on the live pool")
        result = answer["data"]["result"]
        if expression.is_alert:
            if result:
                problems.append(f"{expression.where}: fires on a healthy pool: {result}")
        elif not result and not quiet and not _data_within(live_pool, expression.expr, DATA_TIMEOUT_S):
            # (over a quiet counter, empty is a healthy answer)
            problems.append(f"{expression.where}: returned no data: {expression.expr}")
    assert not problems, "\n".join(problems)


def test_the_charts_rules_evaluate_without_error(live_pool: str) -> None:
    groups = _api(live_pool, "/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(ALERTS)
    _wait_for("every rule to have been evaluated",
              lambda: all(r.get("lastEvaluation", "").startswith("2") and r["health"] != "unknown"
                          for g in _api(live_pool, "/api/v1/rules")["data"]["groups"] for r in g["rules"]),
              30.0)
    groups = _api(live_pool, "/api/v1/rules")["data"]["groups"]
    bad = [(r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad

    def active() -> list[str]:
        return [r["name"] for g in _api(live_pool, "/api/v1/rules")["data"]["groups"] for r in g["rules"]
                if r.get("state") != "inactive"]

    # Firing is never acceptable; a pending alert must clear on a healthy pool.  (One operator scrape
    # that timed out on a loaded 2-core machine made WarmpoolOperatorDown pending for a round.)
    assert not [r["name"] for g in groups for r in g["rules"] if r.get("state") == "firing"]
    _wait_for("no alert pending or firing on a healthy pool", lambda: not active() or None, DATA_TIMEOUT_S, 2.0)


# ---------------------------------------------------------------------------------------------------------
# Each alert driven into the state it names, on the module's live pool, until the real Prometheus fires it.
# These run last: they leave the release broken on purpose (a pool at zero, the operator scaled to 0).


def _firing(url: str, alert: str, **labels: str) -> list[dict[str, Any]]:
    matchers = "".join(f', {key}="{value}"' for key, value in labels.items())
    return _series(url, f'ALERTS{{alertname="{alert}", alertstate="firing"{matchers}}}')


def _fires(url: str, alert: str, **labels: str) -> dict[str, str]:
    """Wait (bounded) for ``alert`` with ``labels`` to fire; its labels."""
    (found, *_) = _wait_for(f"{alert} {labels} firing in Prometheus", lambda: _firing(url, alert, **labels),
                            FIRE_TIMEOUT_S, 2.0)
    got: dict[str, str] = found["metric"]
    return got


def test_a_forbidden_host_path_and_an_unreadable_source_fire_their_alerts(live_pool: str,
                                                                          cluster: ClusterHandle) -> None:
    """A WarmModel refused before it has a child (a hostPath outside operator.allowedHostPaths) still has
    its gauges: it is Degraded and below minWarm.  One whose http source the node agent may not read
    (loopback: refused before any packet leaves the pod) fails its fills on the node, and the operator
    waits for its manifest, a failed pass every retry."""
    forbidden = warmmodel("forbidden", tiny_model(layers=2, name="tiny-llama-2l"))
    forbidden["spec"]["model"] = {"hostPath": {"path": "/srv/not-allowed/model"}, "revision": "r1"}
    unreadable = warmmodel("unreadable", tiny_model(layers=2, name="tiny-llama-2l"))
    unreadable["spec"]["model"] = {"http": {"url": "http://127.0.0.1:9/model"}, "revision": "r1"}
    for obj in (forbidden, unreadable):
        cluster.kubectl("apply", "-n", _NAMESPACE, "-f", "-", input=yaml.safe_dump(obj))
    degraded = _fires(live_pool, "WarmpoolModelDegraded", warmmodel="forbidden")
    assert degraded["reason"] == "HostPathNotAllowed" and degraded["namespace"] == _NAMESPACE, degraded
    _fires(live_pool, "WarmpoolPoolBelowMinWarm", warmmodel="forbidden")
    _fires(live_pool, "WarmpoolPoolBelowMinWarm", warmmodel="unreadable")
    assert _fires(live_pool, "WarmpoolReconcileErrors", reason="temporary")
    failed = _fires(live_pool, "WarmpoolNodeAgentFillFailures", warmmodel="unreadable")
    nodes = cluster.kubectl("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()
    assert failed["stage"] == NODE_AGENT_STAGE_MANIFEST and failed["node"] in nodes, (failed, nodes)
    assert not _firing(live_pool, "WarmpoolModelDegraded", warmmodel="tiny")


def test_a_request_held_past_its_timeout_at_zero_fires_the_activator_alert(live_pool: str,
                                                                           cluster: ClusterHandle) -> None:
    """The pool scales to zero; a request through its Service is held by the activator for one second,
    no pod is warm by then: 503, and WarmpoolActivatorRefusing fires for the pool."""
    patch = {"spec": {"pool": {"scaleToZero": {"afterIdleSeconds": 2, "holdTimeoutSeconds": 1}}}}
    cluster.kubectl("patch", PLURAL, "tiny", "-n", _NAMESPACE, "--type=merge", "-p", json.dumps(patch))

    def at_zero() -> bool:
        """No pod of the pool, and its Service's only addresses the activator's (as the e2e test waits)."""
        replicas = cluster.kubectl("get", "deployment", "tiny", "-n", _NAMESPACE, "-o", "jsonpath={.spec.replicas}")
        pods = json.loads(cluster.kubectl("get", "pods", "-n", _NAMESPACE, "-l", f"{LABEL_MODEL}=tiny",
                                          "-o", "json").stdout)["items"]
        slices = json.loads(cluster.kubectl("get", "endpointslices", "-n", _NAMESPACE, "-l",
                                            f"{LABEL_SERVICE_NAME}=tiny", "-o", "json").stdout)["items"]
        ips = {s["metadata"]["name"]: [a for e in s.get("endpoints") or [] for a in e["addresses"]] for s in slices}
        activators = ips.pop(activator_slice_name("tiny"), [])
        return replicas.stdout == "0" and not pods and bool(activators) and not any(ips.values())

    _wait_for("the pool at zero, its Service routed to the activator", at_zero, FIRE_TIMEOUT_S, 1.0)
    service = json.loads(cluster.kubectl("get", "service", "tiny", "-n", _NAMESPACE, "-o", "json").stdout)
    address = f"{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    assert ipaddress.ip_address(service["spec"]["clusterIP"]) in ipaddress.ip_network(SERVICE_CIDR), address
    code, text = http(f"http://{address}/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2},
                      timeout=30)
    assert code == 503 and json.loads(text)["error"]["type"] == ERROR_HOLD_TIMEOUT, (code, text)
    refused = _fires(live_pool, "WarmpoolActivatorRefusing", warmmodel="tiny")
    assert refused["outcome"] == "timed_out" and refused["namespace"] == _NAMESPACE, refused


def test_the_operator_scaled_to_zero_fires_operator_down(live_pool: str, cluster: ClusterHandle) -> None:
    cluster.kubectl("scale", "-n", _NAMESPACE, f"deployment/{RELEASE}-warmpool", "--replicas=0")
    _fires(live_pool, "WarmpoolOperatorDown")
