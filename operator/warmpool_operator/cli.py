"""`warmpool operator`: run the operator (kopf, in-process) against the cluster of $KUBECONFIG
(or the in-cluster service account).

    warmpool operator --namespace team-a --namespace team-b
    warmpool operator --all-namespaces --scrape-interval 5 --metrics-port 9090

Several replicas may run with ``--leader-elect``: exactly one acts, the one holding the
``coordination.k8s.io`` Lease (see leader.py); the others wait to take over.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import logging
import os
import sys

from warmpool import contract
from warmpool.logformat import configure_logging


class _QuietTimers(logging.Filter):
    """Drop kopf's "Timer 'tick' succeeded." lines; failures and everything else stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Timer ") and message.endswith(" succeeded."))


def build_parser() -> argparse.ArgumentParser:
    from warmpool_operator.host_paths import DEFAULT_ALLOWED_HOST_PATHS

    parser = argparse.ArgumentParser(prog="warmpool operator", description="Run the warmpool operator.")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], metavar="NS", help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch WarmModels cluster-wide")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=contract.DEFAULT_SCRAPE_INTERVAL_SECONDS,
        help="seconds between scrapes of each WarmModel's worker pods (and reconcile passes)",
    )
    parser.add_argument("--scrape-timeout", type=float, default=3.0, help="seconds one pod's scrape may take")
    parser.add_argument("--scrape-concurrency", type=int, default=16, help="pods scraped at once per WarmModel")
    parser.add_argument(
        "--scrape-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="only dial pod IPs in this network (repeatable; default: any)",
    )
    parser.add_argument(
        "--allowed-host-path",
        action="append",
        default=None,
        metavar="PREFIX",
        help="a node directory a WarmModel's hostPath or nodeCache may lie under (repeatable; "
        f"default: {' and '.join(DEFAULT_ALLOWED_HOST_PATHS)}); a WarmModel outside every prefix is Degraded",
    )
    parser.add_argument(
        "--block-cache-root",
        default=contract.DEFAULT_BLOCK_CACHE_ROOT,
        help="the node agents' cache root on the nodes (where http/s3 sources' pods find their revision; "
        "must lie under an --allowed-host-path)",
    )
    parser.add_argument(
        "--heat-write-interval", type=float, default=60.0, help="least seconds between heat-map writes"
    )
    parser.add_argument(
        "--permanent-retry-interval",
        type=float,
        default=300.0,
        help="seconds before a WarmModel whose child the API server refused is tried again unchanged",
    )
    parser.add_argument(
        "--watch-server-timeout",
        type=int,  # sent as the watch's timeoutSeconds, which the API server parses as an integer
        default=120,
        help="whole seconds after which the API server ends each watch (the operator starts the next)",
    )
    parser.add_argument(
        "--watch-inactivity-timeout",
        type=float,
        default=70.0,
        help="seconds a watch may carry nothing, not even the bookmark the API server sends each "
        "minute, before it is taken for stalled and dialled again",
    )
    parser.add_argument(
        "--resync-interval",
        type=float,
        default=600.0,
        help="seconds between checks that every object the operator holds still exists (deletions "
        "made while a watch was down get no event); a watch seen listing again checks at once",
    )
    parser.add_argument(
        "--predict-step-seconds",
        type=int,
        default=60,
        help="demand prediction's history step in seconds (default 60; shorter only for tests and demos: "
        "it must divide 3600, and the history holds the same number of steps, 10080, whatever the step)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=contract.DEFAULT_OPERATOR_METRICS_PORT,
        help="port of the operator's own /metrics (0: off)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=contract.DEFAULT_OPERATOR_LIVENESS_PORT,
        help="port of kopf's liveness endpoint /healthz (0: off)",
    )
    parser.add_argument("--bind", default="0.0.0.0", help="address the metrics and liveness endpoints bind")
    parser.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING")
    parser.add_argument("--log-format", choices=contract.LOG_FORMATS, default=contract.LOG_FORMAT_TEXT,
                        help="text, or json: one object per line, with trace_id/span_id while a span is active")
    parser.add_argument(
        "--leader-elect", action="store_true", help="act only while holding the leader Lease (run several replicas)"
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the leader Lease (default: $POD_NAMESPACE, else the first --namespace)",
    )
    parser.add_argument("--leader-election-name", default="warmpool-operator", help="name of the leader Lease")
    return parser


#: Scrapes a demand step should see: a step with none is stored as missing, not as zero demand.
SCRAPES_PER_STEP = 3


def config_warnings(scrape_interval: float, predict_step_seconds: int) -> list[str]:
    """Flag combinations that run, but not as a user would want (logged at start)."""
    warnings = []
    if predict_step_seconds < SCRAPES_PER_STEP * scrape_interval:
        warnings.append(
            f"--predict-step-seconds {predict_step_seconds} is shorter than {SCRAPES_PER_STEP} scrapes "
            f"(--scrape-interval {scrape_interval:g}s): steps that see no scrape are stored as missing and "
            f"the forecast has little to learn from; use a step of at least "
            f"{SCRAPES_PER_STEP * scrape_interval:g}s or a shorter --scrape-interval")
    return warnings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.scrape_interval, args.scrape_timeout, args.scrape_concurrency, args.permanent_retry_interval) <= 0:
        print("warmpool operator: intervals, timeouts and concurrency must be positive", file=sys.stderr)
        return 2
    if min(args.watch_server_timeout, args.watch_inactivity_timeout, args.resync_interval) <= 0:
        print("warmpool operator: --watch-server-timeout, --watch-inactivity-timeout and --resync-interval "
              "must be positive", file=sys.stderr)
        return 2
    try:
        networks = [ipaddress.ip_network(text, strict=False) for text in args.scrape_network]
    except ValueError as error:
        print(f"warmpool operator: bad --scrape-network: {error}", file=sys.stderr)
        return 2
    if not 1 <= args.predict_step_seconds <= 3600 or 3600 % args.predict_step_seconds:
        print(f"warmpool operator: --predict-step-seconds must divide 3600, got {args.predict_step_seconds}",
              file=sys.stderr)
        return 2
    from warmpool_operator.host_paths import DEFAULT_ALLOWED_HOST_PATHS, BadHostPathPrefix, normalise_prefixes

    try:
        host_paths = normalise_prefixes(
            DEFAULT_ALLOWED_HOST_PATHS if args.allowed_host_path is None else args.allowed_host_path
        )
    except BadHostPathPrefix as error:
        print(f"warmpool operator: bad {error}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    for warning in config_warnings(args.scrape_interval, args.predict_step_seconds):
        logging.getLogger("warmpool.operator").warning("%s", warning)
    from warmpool_operator import tracing

    if tracing.enable_from_env():  # OTEL_EXPORTER_OTLP_ENDPOINT set: a trace per reconcile pass
        import atexit

        atexit.register(tracing.shutdown)

    # kopf logs every successful timer run at INFO: once a second per WarmModel in tests.
    logging.getLogger("kopf.objects").addFilter(_QuietTimers())

    from warmpool_operator.settings import CONFIG

    CONFIG.scrape_interval = args.scrape_interval
    CONFIG.scrape_timeout = args.scrape_timeout
    CONFIG.scrape_concurrency = args.scrape_concurrency
    CONFIG.scrape_networks = networks
    CONFIG.heat_write_interval = args.heat_write_interval
    CONFIG.permanent_retry_interval = args.permanent_retry_interval
    CONFIG.allowed_host_paths = host_paths
    CONFIG.watch_server_timeout = args.watch_server_timeout
    CONFIG.watch_inactivity_timeout = args.watch_inactivity_timeout
    CONFIG.resync_interval = args.resync_interval
    CONFIG.block_cache_root = args.block_cache_root
    CONFIG.predict_step_seconds = args.predict_step_seconds

    import kopf

    # Handlers register on import; the timer's interval is read then, so CONFIG comes first.
    importlib.import_module("warmpool_operator.handlers")
    from warmpool_operator import metrics

    if args.leader_elect:
        import asyncio

        from warmpool_operator import leader

        lease_namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or (
            args.namespace[0] if args.namespace else None)
        if not lease_namespace:
            print("warmpool operator: --leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)",
                  file=sys.stderr)
            return 2
        lease = leader.LeaderConfig(namespace=lease_namespace, name=args.leader_election_name,
                                    identity=leader.default_identity())
        standby = leader.serve_standby_health(args.bind, args.liveness_port) if args.liveness_port > 0 else None
        asyncio.run(leader.acquire(lease))  # a standby waits here: no watch, no write, no scrape
        if standby is not None:
            leader.stop_standby_health(standby)
        leader.keep_renewing(lease)

    metrics.serve(args.metrics_port, args.bind)
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port > 0 else None
    kopf.run(
        clusterwide=bool(args.all_namespaces),
        namespaces=list(args.namespace),
        liveness_endpoint=liveness,
        standalone=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
