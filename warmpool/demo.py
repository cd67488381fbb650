"""`warmpool demo`: the main job end to end on a local cluster.

Placeholder until the demo lands: it brings the local control plane up, shows its nodes,
and says plainly which parts of the story are not wired in yet.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="warmpool demo", description=__doc__)
    parser.add_argument("--down", action="store_true", help="stop the demo cluster and clean up")
    args = parser.parse_args(argv)

    from warmpool_devcluster import cluster

    if args.down:
        cluster.down("demo")
        return 0
    try:
        kubeconfig = cluster.up("demo")
    except cluster.ClusterError as error:
        print(f"warmpool demo: {error}", file=sys.stderr)
        return 1
    print(cluster.kubectl("demo", "get", "nodes", "-o", "wide").stdout)
    print(f"The local cluster is up (kubeconfig: {kubeconfig}).\n"
          "Not wired into the demo yet: the operator, the WarmModel of the small real model, "
          "the warm-up progress view and the cold-start phase table.\n"
          "Run `make demo-down` to stop the cluster.")
    return 0
