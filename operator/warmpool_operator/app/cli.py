"""`warmpool operator`: run the operator (kopf, in-process) against the cluster of $KUBECONFIG
(or the in-cluster service account).

    warmpool operator --namespace team-a --namespace team-b
    warmpool operator --all-namespaces --scrape-interval 5 --metrics-port 9090

The flags become one frozen :class:`~warmpool_operator.settings.OperatorConfig`, built here and
nowhere else, and travel in kopf's ``memo`` (with the tracing set up from the environment) to
the handlers, the registry and every reconciler.

Several replicas may run with ``--leader-elect``: exactly one acts, the one holding the
``coordination.k8s.io`` Lease (see app/leader.py); the others wait to take over.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import ipaddress
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from warmpool.contract.telemetry import LOG_FORMAT_TEXT, LOG_FORMATS
from warmpool.logformat import add_log_level_flag, configure_logging
from warmpool_operator.rules.host_paths import DEFAULT_ALLOWED_HOST_PATHS, BadHostPathPrefix, normalise_prefixes
from warmpool_operator.rules.node_leases import KUBELET_RENEW_INTERVAL_S, MIN_GRACE_S
from warmpool_operator.settings import SCRAPES_PER_STEP, OperatorConfig, default_predict_step

if TYPE_CHECKING:
    from warmpool_operator.app.leader import Renewal

DEFAULT_OPERATOR_HEALTH_PORT = 8081
DEFAULT_OPERATOR_METRICS_PORT = 9090


#: The defaults every flag shows, from the settings type itself (one place owns each default).
DEFAULTS = OperatorConfig()


class BadFlags(ValueError):
    """Flags that parse but cannot work together (the message names them)."""


class _DeprecatedAlias(argparse.Action):
    """An old flag name that still works: sets the new flag's value and says, on stderr, to use it."""

    def __init__(self, option_strings: list[str], dest: str, canonical: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.canonical = canonical

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.canonical}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _scrape_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=DEFAULTS.scrape_interval,
        help="seconds between scrapes of each WarmModel's worker pods (and reconcile passes)",
    )
    parser.add_argument("--scrape-timeout", type=float, default=DEFAULTS.scrape_timeout,
                        help="seconds one pod's scrape may take")
    parser.add_argument("--scrape-concurrency", type=int, default=DEFAULTS.scrape_concurrency,
                        help="pods scraped at once per WarmModel")
    parser.add_argument("--api-concurrency", type=int, default=DEFAULTS.api_concurrency,
                        help="API server requests in flight at once (watches apart); the rest wait their turn")
    parser.add_argument(
        "--scrape-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="only dial pod IPs in this network (repeatable; default: any)",
    )


def _pool_flags(parser: argparse.ArgumentParser) -> None:
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
        default=DEFAULTS.block_cache_root,
        help="the node agents' cache root on the nodes (where http/s3 sources' pods find their revision; "
        "must lie under an --allowed-host-path)",
    )
    parser.add_argument(
        "--worker-image",
        default=DEFAULTS.worker_image,
        help="the worker image of pods whose WarmModel names none in spec.pod.image (the chart passes "
        f"its workerImage value; default: {DEFAULTS.worker_image})",
    )
    parser.add_argument(
        "--activator-service",
        default=None,
        metavar="NAMESPACE/NAME",
        help="the activator's Service (the chart's <release>-activator): scale-to-zero pools at zero route "
        "to its pods' addresses; unset: no activator, and such pools have no endpoint while at zero",
    )
    parser.add_argument(
        "--worker-policy-ingress",
        default=None,
        metavar="JSON",
        help="make a NetworkPolicy over each pool's worker pods, in the pool's namespace, with these ingress "
        "rules (a JSON list of NetworkPolicyIngressRule; the chart renders its worker policy's in cluster-wide "
        "mode); unset: none",
    )
    parser.add_argument("--heat-write-interval", type=float, default=DEFAULTS.heat_write_interval,
                        help="least seconds between heat-map writes")
    parser.add_argument(
        "--permanent-retry-interval",
        type=float,
        default=DEFAULTS.permanent_retry_interval,
        help="seconds before a WarmModel whose child the API server refused is tried again unchanged",
    )
    parser.add_argument(
        "--predict-step-seconds",
        type=int,
        default=None,
        help="demand prediction's fine history step in seconds (it must divide 3600; default: the shortest "
        f"that sees {SCRAPES_PER_STEP} scrapes, {DEFAULTS.predict_step_seconds} at the default --scrape-interval); "
        "a coarse tier beside the fine steps keeps weeks",
    )


def _watch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--watch-server-timeout",
        type=int,  # sent as the watch's timeoutSeconds, which the API server parses as an integer
        default=DEFAULTS.watch_server_timeout,
        help="whole seconds after which the API server ends each watch (the operator starts the next)",
    )
    parser.add_argument(
        "--watch-inactivity-timeout",
        type=float,
        default=DEFAULTS.watch_inactivity_timeout,
        help="seconds a watch may carry nothing, not even the bookmark the API server sends each "
        "minute, before it is taken for stalled and dialled again",
    )
    parser.add_argument(
        "--resync-interval",
        type=float,
        default=DEFAULTS.resync_interval,
        help="seconds between checks that every object the operator holds still exists (deletions "
        "made while a watch was down get no event); a watch seen listing again checks at once",
    )
    parser.add_argument(
        "--node-lease-grace-seconds",
        type=float,
        default=DEFAULTS.node_lease_grace_seconds,
        help="seconds after which a node whose kubelet renewed no Lease, while another node's did, is "
        f"taken for lost and its pods replaced (0: wait for its Ready condition; else at least {MIN_GRACE_S:g})",
    )
    parser.add_argument(
        "--node-probe-interval",
        type=float,
        default=DEFAULTS.node_probe_interval,
        help="seconds between TCP knocks on one worker pod per node, so a node whose pods stop answering "
        "while another node's answer is judged within seconds, not a scrape round (0: the scrapes alone)",
    )


def _process_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_OPERATOR_METRICS_PORT,
        help="port of the operator's own /metrics (0: off)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=DEFAULT_OPERATOR_HEALTH_PORT,
        help="port of the liveness endpoint /healthz (kopf's; a standby's own) (0: off)",
    )
    # The flag's name before the activator's and node agent's --health-port set the one name:
    # still accepted, so an older chart or script goes on working, and hidden from --help.
    parser.add_argument("--liveness-port", type=int, dest="health_port", default=argparse.SUPPRESS,
                        action=_DeprecatedAlias, canonical="--health-port", help=argparse.SUPPRESS)
    parser.add_argument("--bind", default="0.0.0.0", help="address the metrics and liveness endpoints bind")
    add_log_level_flag(parser)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMAT_TEXT,
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
    parser.add_argument(
        "--control-key-secret", default=DEFAULTS.control_key_secret,
        help="the Secret holding the key every worker's control token derives from; made when missing "
             f"(default: {DEFAULTS.control_key_secret})",
    )
    parser.add_argument(
        "--control-key-namespace", default=None,
        help="its namespace (default: --leader-election-namespace, else $POD_NAMESPACE, else the first --namespace)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool operator", description="Run the warmpool operator.")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], metavar="NS", help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch WarmModels cluster-wide")
    for flags in (_scrape_flags, _pool_flags, _watch_flags, _process_flags):
        flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The operator's settings from its flags; :class:`BadFlags` when they cannot work."""
    if min(args.scrape_interval, args.scrape_timeout, args.scrape_concurrency, args.permanent_retry_interval,
           args.api_concurrency) <= 0:
        raise BadFlags("intervals, timeouts and concurrency must be positive")
    if min(args.watch_server_timeout, args.watch_inactivity_timeout, args.resync_interval) <= 0:
        raise BadFlags("--watch-server-timeout, --watch-inactivity-timeout and --resync-interval must be positive")
    if args.node_probe_interval < 0:
        raise BadFlags(f"--node-probe-interval must be 0 (off) or positive, got {args.node_probe_interval:g}")
    if args.node_lease_grace_seconds != 0 and not args.node_lease_grace_seconds >= MIN_GRACE_S:
        raise BadFlags(f"--node-lease-grace-seconds must be 0 (off) or at least {MIN_GRACE_S:g}: a kubelet renews "
                       f"its Lease every {KUBELET_RENEW_INTERVAL_S:g} s, got {args.node_lease_grace_seconds:g}")
    try:
        networks = tuple(ipaddress.ip_network(text, strict=False) for text in args.scrape_network)
    except ValueError as error:
        raise BadFlags(f"bad --scrape-network: {error}") from None
    predict_step = (default_predict_step(args.scrape_interval) if args.predict_step_seconds is None
                    else args.predict_step_seconds)
    if not 1 <= predict_step <= 3600 or 3600 % predict_step:
        raise BadFlags(f"--predict-step-seconds must divide 3600, got {predict_step}")
    try:
        host_paths = normalise_prefixes(
            DEFAULT_ALLOWED_HOST_PATHS if args.allowed_host_path is None else args.allowed_host_path
        )
    except BadHostPathPrefix as error:
        raise BadFlags(f"bad {error}") from None
    activator: tuple[str, str] | None = None
    if args.activator_service is not None:
        namespace, _, name = str(args.activator_service).partition("/")
        if not namespace or not name or "/" in name:
            raise BadFlags(f"--activator-service must be NAMESPACE/NAME, got {args.activator_service!r}")
        activator = (namespace, name)
    return OperatorConfig(
        activator_service=activator,
        worker_policy_ingress=worker_policy_ingress(args.worker_policy_ingress),
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        scrape_concurrency=args.scrape_concurrency,
        api_concurrency=args.api_concurrency,
        scrape_networks=networks,
        heat_write_interval=args.heat_write_interval,
        permanent_retry_interval=args.permanent_retry_interval,
        predict_step_seconds=predict_step,
        allowed_host_paths=host_paths,
        watch_server_timeout=args.watch_server_timeout,
        watch_inactivity_timeout=args.watch_inactivity_timeout,
        resync_interval=args.resync_interval,
        node_lease_grace_seconds=args.node_lease_grace_seconds,
        node_probe_interval=args.node_probe_interval,
        block_cache_root=args.block_cache_root,
        worker_image=args.worker_image,
        control_key_namespace=_control_key_namespace(args),
        control_key_secret=args.control_key_secret,
    )


def worker_policy_ingress(text: str | None) -> tuple[dict[str, Any], ...] | None:
    """--worker-policy-ingress: a JSON list of NetworkPolicy ingress rules, each holding only
    ``from`` and ``ports`` lists of objects (the API server checks the rest when the policy is made)."""
    if text is None:
        return None
    try:
        rules = json.loads(text)
    except ValueError as error:
        raise BadFlags(f"--worker-policy-ingress is not JSON: {error}") from None
    if not isinstance(rules, list):
        raise BadFlags("--worker-policy-ingress must be a JSON list of ingress rules")
    for number, rule in enumerate(rules):
        if not isinstance(rule, dict) or not set(rule) <= {"from", "ports"}:
            raise BadFlags(f"--worker-policy-ingress rule {number}: an object with only 'from' and 'ports'")
        for key in ("from", "ports"):
            if not isinstance(rule.get(key, []), list) or not all(isinstance(x, dict) for x in rule.get(key, [])):
                raise BadFlags(f"--worker-policy-ingress rule {number}: {key!r} must be a list of objects")
    return tuple(rules)


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


def _control_key_namespace(args: argparse.Namespace) -> str:
    namespace = args.control_key_namespace or args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or (
        args.namespace[0] if args.namespace else None)
    if not namespace:
        raise BadFlags("--all-namespaces outside a pod needs --control-key-namespace (where the control key's Secret "
                       "is kept), or $POD_NAMESPACE")
    return str(namespace)


def _lease_namespace(args: argparse.Namespace) -> str:
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or (
        args.namespace[0] if args.namespace else None)
    if not namespace:
        raise BadFlags("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)")
    return str(namespace)


def missing_credentials() -> str | None:
    """Why the operator could reach no API server, in one line; None when a service account (in a
    pod) or a kubeconfig file is there.  Checked before kopf starts: kopf retries its login and
    start-up and prints each try's tracebacks (295 lines) before it gives up on a missing kubeconfig."""
    from kubernetes_asyncio.config.incluster_config import SERVICE_TOKEN_FILENAME

    if os.path.isfile(SERVICE_TOKEN_FILENAME):
        return None
    named = os.environ.get("KUBECONFIG")
    paths = [os.path.expanduser(path) for path in (named or "~/.kube/config").split(os.pathsep) if path]
    if any(os.path.isfile(path) for path in paths):
        return None
    where = f"$KUBECONFIG names no file ({named})" if named else f"$KUBECONFIG is unset and {paths[0]} is missing"
    return (f"no Kubernetes credentials: not in a pod (no service account token at {SERVICE_TOKEN_FILENAME}) and "
            f"no kubeconfig ({where}); set KUBECONFIG to a kubeconfig file, or run it in a cluster")


def _lead(args: argparse.Namespace) -> Renewal:
    """Wait until this replica holds the leader Lease (a standby: no watch, no write, no scrape),
    answering the liveness probe meanwhile; then renew it from a thread of its own."""
    from warmpool_operator.app import leader

    lease = leader.LeaderConfig(namespace=_lease_namespace(args), name=args.leader_election_name,
                                identity=leader.default_identity())
    standby = leader.serve_standby_health(args.bind, args.health_port) if args.health_port > 0 else None
    renewed = asyncio.run(leader.acquire(lease))
    if standby is not None:
        leader.stop_standby_health(standby)
    return leader.Renewal(lease, renewed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.leader_elect:
            _lease_namespace(args)  # refused before anything starts
    except BadFlags as error:
        print(f"warmpool operator: {error}", file=sys.stderr)
        return 2
    missing = missing_credentials()
    if missing is not None:
        print(f"warmpool operator: {missing}", file=sys.stderr)
        return 1
    configure_logging(args.log_level, args.log_format)
    for warning in config_warnings(config.scrape_interval, config.predict_step_seconds):
        logging.getLogger("warmpool.operator").warning("%s", warning)

    import kopf
    from kopf._core.engines.peering import Identity  # kopf.run's parameter type, not re-exported by kopf

    from warmpool_operator.app.leader import default_identity
    from warmpool_operator.io import metrics
    from warmpool_operator.io.tracing import Tracing

    tracing = Tracing.from_env()  # OTEL_EXPORTER_OTLP_ENDPOINT set: a trace per reconcile pass
    atexit.register(tracing.shutdown)
    handlers = importlib.import_module("warmpool_operator.app.handlers")  # they register with kopf on import
    if config.worker_policy_ingress is not None:
        handlers.watch_worker_policies()
    # Before the Lease is ours: a standby answers /metrics too (process figures, no WarmModel's), so
    # no replica is a scrape target down for ever (kube-prometheus-stack's TargetDown).
    metrics.serve(args.metrics_port, args.bind)
    renewal = _lead(args) if args.leader_elect else None
    try:
        liveness = f"http://{args.bind}:{args.health_port}/healthz" if args.health_port > 0 else None
        kopf.run(
            clusterwide=bool(args.all_namespaces),
            namespaces=list(args.namespace),
            liveness_endpoint=liveness,
            standalone=True,
            # An explicit identity: kopf would otherwise look the process's user up (getpass), which
            # raises for a UID with no passwd entry -- an image's non-root UID often has none.
            identity=Identity(default_identity()),
            memo=kopf.Memo(config=config, tracing=tracing),
        )
    finally:
        # kopf has stopped (its SIGTERM), or never got as far as its own handler (warmpool.cli's
        # SIGTERM, while kopf started): nothing acts any more, so hand the Lease on at once.
        if renewal is not None:
            renewal.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
