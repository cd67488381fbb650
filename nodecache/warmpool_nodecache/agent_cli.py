"""``warmpool node-agent``: fill this node's model cache for the WarmModels that need it (see agent_loop.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path

from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool.contract.telemetry import LOG_FORMAT_TEXT, LOG_FORMATS
from warmpool.logformat import add_log_level_flag, configure_logging
from warmpool_nodecache.agent_loop import AgentConfig, run_agent
from warmpool_nodecache.netguard import AddressPolicy, LiveNetworks
from warmpool_nodecache.source import ReadLimits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool node-agent", description=__doc__)
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                        help="this node's name (default: $NODE_NAME, the downward API's spec.nodeName)")
    parser.add_argument("--cache-root", type=Path, default=Path(DEFAULT_BLOCK_CACHE_ROOT), help="the cache root")
    parser.add_argument("--budget-bytes", type=int, default=None,
                        help="evict (LRU-2) down to this many bytes; never a revision in use (default: no eviction)")
    parser.add_argument("--namespace", default=None, help="watch WarmModels of this namespace only (default: all)")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or "default",
                        help="namespace of the fill Leases (default: $POD_NAMESPACE, else default)")
    parser.add_argument("--interval", type=float, default=10.0,
                        help="most seconds between passes (a watched WarmModel or pod change starts one at once)")
    parser.add_argument("--lease-duration", type=float, default=15.0,
                        help="seconds a fill Lease lasts unrenewed (a killed agent's fill resumes after it)")
    parser.add_argument("--progress-interval", type=float, default=10.0,
                        help="least seconds between two status writes that only move bytes cached")
    parser.add_argument("--partial-view", action="store_true",
                        help="fill as a partial view a worker can start on (--partial-cache on <root>/partial/<hex>)")
    sources = parser.add_argument_group(
        "model sources", "what the agent may read from the URLs and endpoints WarmModels name")
    sources.add_argument("--cluster-network", action="append", default=[], metavar="CIDR",
                         help="a network of the cluster's own that sources may not be read from, beyond those "
                              "the agent finds (the Service ranges, the Nodes' pod ranges and addresses), e.g. "
                              "a CNI's own pod pools (repeatable; loopback, link-local and cloud metadata "
                              "addresses are always refused)")
    sources.add_argument("--cluster-networks-refresh", type=float, default=60.0, metavar="SECONDS",
                         help="seconds between two discoveries of the cluster's networks (default: %(default)s)")
    sources.add_argument("--source-allow-network", action="append", default=[], metavar="CIDR",
                         help="a network sources may be read from even inside a refused range, e.g. an "
                              "in-cluster object store's Service IP (repeatable)")
    sources.add_argument("--max-manifest-bytes", type=int, default=ReadLimits.max_manifest_bytes,
                         help="the largest manifest read (default: %(default)s)")
    sources.add_argument("--max-block-bytes", type=int, default=ReadLimits.max_block_bytes,
                         help="the largest block_size a manifest may ask for (default: %(default)s)")
    sources.add_argument("--source-deadline", type=float, default=ReadLimits.deadline_s,
                         help="seconds one read from a source may take in all, retries included "
                              "(default: %(default)s)")
    sources.add_argument("--manifest-reads", type=int, default=4,
                         help="manifests read at once (default: %(default)s)")
    sources.add_argument("--s3-default-credentials", action="store_true",
                         help="sign for an s3 source without a secretRef with this process's own credentials "
                              "(boto3's default chain: environment, web identity such as IRSA, AWS_PROFILE, "
                              "container or instance metadata) instead of unsigned; it lends them to every "
                              "WarmModel the agent serves")
    endpoints = parser.add_argument_group("endpoints", "the agent's own: the kubelet's probes and Prometheus")
    endpoints.add_argument("--bind", default="0.0.0.0", help="address the probe and metrics endpoints bind")
    endpoints.add_argument("--health-port", type=int, default=0,
                           help="/healthz (liveness) and /readyz (a pass finished); 0: none (default)")
    endpoints.add_argument("--metrics-port", type=int, default=0,
                           help="Prometheus metrics (failed and finished fills); 0: none (default)")
    add_log_level_flag(parser)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMAT_TEXT,
                        help="log lines as text or one JSON object each (default: %(default)s)")
    return parser


def source_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[AddressPolicy, ReadLimits]:
    """The address policy and read limits the flags ask for (a parser error naming a bad one)."""
    try:
        policy = AddressPolicy.from_flags(args.cluster_network, args.source_allow_network, LiveNetworks())
        limits = ReadLimits(max_manifest_bytes=args.max_manifest_bytes, max_block_bytes=args.max_block_bytes,
                            deadline_s=args.source_deadline)
        limits.check()
    except ValueError as error:
        parser.error(str(error))
    if args.manifest_reads < 1:
        parser.error(f"--manifest-reads must be at least 1, got {args.manifest_reads}")
    if not args.cluster_networks_refresh >= 1:
        parser.error(f"--cluster-networks-refresh must be at least 1 second, got {args.cluster_networks_refresh}")
    return policy, limits


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.node_name:
        parser.error("--node-name (or $NODE_NAME) is required")
    if args.budget_bytes is not None and args.budget_bytes < 0:
        parser.error(f"--budget-bytes must be >= 0, got {args.budget_bytes}")
    for flag, port in (("--health-port", args.health_port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} must be a port number (0: none), got {port}")
    if args.health_port and args.health_port == args.metrics_port:
        parser.error(f"--health-port and --metrics-port must differ, both are {args.health_port}")
    if args.interval <= 0 or args.lease_duration < 1:
        parser.error("--interval must be positive and --lease-duration at least 1 second")
    policy, limits = source_settings(parser, args)
    configure_logging(args.log_level, args.log_format)
    config = AgentConfig(node=args.node_name, cache_root=args.cache_root, budget_bytes=args.budget_bytes,
                         namespace=args.namespace, lease_namespace=args.lease_namespace, interval_s=args.interval,
                         lease_duration_s=args.lease_duration, progress_interval_s=args.progress_interval,
                         partial_view=args.partial_view, policy=policy, limits=limits,
                         manifest_reads=args.manifest_reads, s3_default_credentials=args.s3_default_credentials,
                         cluster_networks_refresh_s=args.cluster_networks_refresh, bind=args.bind,
                         health_port=args.health_port, metrics_port=args.metrics_port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await run_agent(config, stop)

    asyncio.run(run())
    return 0
