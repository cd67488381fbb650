"""``warmpool node-agent``: fill this node's model cache for the WarmModels that need it (see agent_loop.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from warmpool.contract import DEFAULT_BLOCK_CACHE_ROOT
from warmpool_nodecache.agent_loop import AgentConfig, run_agent


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
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.node_name:
        parser.error("--node-name (or $NODE_NAME) is required")
    if args.budget_bytes is not None and args.budget_bytes < 0:
        parser.error(f"--budget-bytes must be >= 0, got {args.budget_bytes}")
    if args.interval <= 0 or args.lease_duration < 1:
        parser.error("--interval must be positive and --lease-duration at least 1 second")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = AgentConfig(node=args.node_name, cache_root=args.cache_root, budget_bytes=args.budget_bytes,
                         namespace=args.namespace, lease_namespace=args.lease_namespace, interval_s=args.interval,
                         lease_duration_s=args.lease_duration, progress_interval_s=args.progress_interval,
                         partial_view=args.partial_view)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await run_agent(config, stop)

    asyncio.run(run())
    return 0
