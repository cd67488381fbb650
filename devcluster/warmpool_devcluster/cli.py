"""`warmpool cluster build | host-packages | up | down | status | kubeconfig`: the local cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from warmpool_devcluster import (
    build,
    cluster,
    host_packages,
    jaeger,
    node,
    processes,
    prometheus,
    prometheus_config,
    seaweedfs,
)


def _parser() -> argparse.ArgumentParser:
    # --name is accepted before or after the action (`cluster --name x down` or `cluster down --name x`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=argparse.SUPPRESS,
                        help="cluster name (state under ~/.cache/warmpool/clusters/NAME)")
    parser = argparse.ArgumentParser(prog="warmpool cluster", description=__doc__, parents=[common])
    sub = parser.add_subparsers(dest="action", required=True)
    build_parser = sub.add_parser("build", help="build (or find cached) every binary the cluster and tests need",
                                  parents=[common])
    build_parser.add_argument("--with-object-store", action="store_true",
                              help="also build SeaweedFS' weed (a long first build; only the object-store "
                                   "tests and `up --with-object-store` need it)")
    up = sub.add_parser("up", help="start the cluster, or confirm it is already up", parents=[common])
    up.add_argument("--node-runtime", choices=cluster.NODE_RUNTIMES, default="kwok",
                    help="containerd: one real node (kubelet, kube-proxy, containerd, bridge CNI; needs root and "
                         "`make host-packages`), pods in real containers from local images; kwok (default): fake "
                         "nodes only, nothing runs (the scale benchmark); none: an API server alone, no "
                         "controllers and no nodes (tests that play the controllers themselves)")
    up.add_argument("--fake-nodes", type=int, default=None,
                    help=f"kwok fake nodes to register (default: {cluster.DEFAULT_FAKE_NODES} on a kwok cluster, "
                         "none beside a real node)")
    up.add_argument("--nodes", type=int, default=1,
                    help="real nodes with --node-runtime containerd (default 1): node 0 in this machine's "
                         "namespaces, each further one in network and mount namespaces of its own, with its own "
                         "containerd, kubelet, kube-proxy, cgroup parent and /var/lib/warmpool")
    up.add_argument("--port", type=int, default=None, help="kube-apiserver port (default: a free one)")
    up.add_argument("--with-observability", action="store_true",
                    help="also start Prometheus on 127.0.0.1, scraping the operator and worker pods the way "
                         "the chart's monitors select them, with the chart's alert rules, and Jaeger "
                         "(OTLP/HTTP in, its UI and query API out), both on 127.0.0.1")
    up.add_argument("--with-object-store", action="store_true",
                    help="also start SeaweedFS (an S3-compatible store) on 127.0.0.1 with fresh credentials "
                         "(an AWS credentials file, mode 0600, under the cluster's state) and a 'models' bucket")
    down = sub.add_parser("down", help="stop every process of the cluster", parents=[common])
    down.add_argument("--purge", action="store_true", help="also delete its certificates and state")
    sub.add_parser("status", help="print the cluster's health as JSON", parents=[common])
    sub.add_parser("host-packages", help="install the Debian packages a real node and image builds need "
                                         f"({', '.join(host_packages.PACKAGES)}) when missing", parents=[common])
    sub.add_parser("kubeconfig", help="print the path of the admin kubeconfig", parents=[common])
    return parser


def observability_dir(name: str) -> Path:
    """Where `up --with-observability` keeps its servers' config, data and logs."""
    return cluster.state_dir(name) / "observability"


def _start_observability(name: str, kubeconfig: Path) -> None:
    """Prometheus and Jaeger beside the cluster, each left running after this command (a second
    `up` finds and reuses them)."""
    work = observability_dir(name)
    url = prometheus.running_url(work / "prometheus")
    if url is None:
        # Rendered for the README's release (`warmpool` in warmpool-system), every namespace watched.
        objects = prometheus_config.render_monitoring(extra_values=["watch.allNamespaces=true"])
        url = prometheus.start_prometheus(work / "prometheus", kubeconfig, objects=objects).url
    print(f"prometheus\t{url}")
    traces = processes.recorded_urls(work / "jaeger", jaeger.PROGRAM)
    if traces is None:
        # Workers in the real node's pods export to the bridge address; the UI stays on loopback.
        handle = jaeger.start_jaeger(work / "jaeger", otlp_address=cluster.pod_gateway(name) or jaeger.LOOPBACK)
        traces = {"ui": handle.query_url, "otlp": handle.otlp_endpoint}
        processes.record(work / "jaeger", jaeger.PROGRAM, handle.process.pid, traces)
    print(f"jaeger\t{traces['ui']}")
    print(f"OTEL_EXPORTER_OTLP_ENDPOINT\t{traces['otlp']}")


def object_store_dir(name: str) -> Path:
    """Where `up --with-object-store` keeps SeaweedFS' data, credentials and log."""
    return cluster.state_dir(name) / "object-store"


def _start_object_store(name: str) -> None:
    """SeaweedFS beside the cluster, left running after this command (a second `up` reuses it)."""
    urls = seaweedfs.ensure_recorded(object_store_dir(name))
    print(f"s3\t{urls['s3']}")
    print(f"s3-bucket\t{urls['bucket']}")
    print(f"s3-credentials\t{urls['credentials']}")


def _stop_observability(name: str) -> None:
    work = observability_dir(name)
    prometheus.stop_recorded(work / "prometheus")
    processes.stop_recorded(work / "jaeger", jaeger.PROGRAM)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.name = getattr(args, "name", "default")
    try:
        if args.action == "build":
            names = None
            if args.with_object_store:
                names = [b.name for b in build.ALL_BINARIES] + list(build.OBJECT_STORE_BINARIES)
            for name, path in build.ensure_binaries(names).items():
                print(f"{name}\t{path}")
        elif args.action == "up":
            kubeconfig = cluster.up(args.name, node_runtime=args.node_runtime, fake_nodes=args.fake_nodes,
                                    apiserver_port=args.port, nodes=args.nodes)
            print(kubeconfig)
            if args.with_observability:
                _start_observability(args.name, kubeconfig)
            if args.with_object_store:
                _start_object_store(args.name)
        elif args.action == "down":
            _stop_observability(args.name)
            seaweedfs.stop_recorded(object_store_dir(args.name))
            if cluster.down(args.name, purge=args.purge):
                return 1
        elif args.action == "status":
            report = cluster.status(args.name)
            print(json.dumps(report, indent=2))
            return 0 if report["running"] else 1
        elif args.action == "host-packages":
            installed = host_packages.ensure()
            print(f"installed: {' '.join(installed)}" if installed else "every host package is present")
        elif args.action == "kubeconfig":
            path = cluster.kubeconfig_path(args.name)
            if not path.exists():
                raise cluster.ClusterError(f"cluster {args.name!r} has no kubeconfig; run `warmpool cluster up`")
            print(path)
    except (cluster.ClusterError, build.BuildError, prometheus.PrometheusError, jaeger.JaegerError,
            seaweedfs.SeaweedError, node.NodeError, host_packages.HostPackagesError) as error:
        print(f"warmpool cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0
