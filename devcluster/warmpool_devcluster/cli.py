"""`warmpool cluster build | up | down | status | kubeconfig`: the local control plane."""

from __future__ import annotations

import argparse
import json
import sys

from warmpool_devcluster import build, cluster


def _parser() -> argparse.ArgumentParser:
    # --name is accepted before or after the action (`cluster --name x down` or `cluster down --name x`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=argparse.SUPPRESS,
                        help="cluster name (state under ~/.cache/warmpool/clusters/NAME)")
    parser = argparse.ArgumentParser(prog="warmpool cluster", description=__doc__, parents=[common])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("build", help="build (or find cached) every binary the cluster and tests need", parents=[common])
    up = sub.add_parser("up", help="start the cluster, or confirm it is already up", parents=[common])
    up.add_argument("--nodes", type=int, default=cluster.DEFAULT_NODES, help="fake (kwok) nodes to register")
    up.add_argument("--port", type=int, default=None, help="kube-apiserver port on 127.0.0.1 (default: a free one)")
    down = sub.add_parser("down", help="stop every process of the cluster", parents=[common])
    down.add_argument("--purge", action="store_true", help="also delete its certificates and state")
    sub.add_parser("status", help="print the cluster's health as JSON", parents=[common])
    sub.add_parser("kubeconfig", help="print the path of the admin kubeconfig", parents=[common])
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.name = getattr(args, "name", "default")
    try:
        if args.action == "build":
            for name, path in build.ensure_binaries().items():
                print(f"{name}\t{path}")
        elif args.action == "up":
            if args.nodes < 1:
                raise cluster.ClusterError("--nodes must be at least 1")
            print(cluster.up(args.name, nodes=args.nodes, apiserver_port=args.port))
        elif args.action == "down":
            cluster.down(args.name, purge=args.purge)
        elif args.action == "status":
            report = cluster.status(args.name)
            print(json.dumps(report, indent=2))
            return 0 if report["running"] else 1
        elif args.action == "kubeconfig":
            path = cluster.kubeconfig_path(args.name)
            if not path.exists():
                raise cluster.ClusterError(f"cluster {args.name!r} has no kubeconfig; run `warmpool cluster up`")
            print(path)
    except (cluster.ClusterError, build.BuildError) as error:
        print(f"warmpool cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0
