"""Which local cluster holds this machine's one real node, and what to run to free it.

A machine runs one real node at a time (node.py says why).  `make test` needs it for the suite's
own cluster, so it asks here first, before it builds anything: another cluster holding the node
(the demo's, left up for exploring) is refused at once with the command that stops it, instead of
after half an hour of builds with every real-node test failing.

Standard library only (with warmpool_dev.paths), so `make` can ask with the system Python before
`.venv` exists:

    PYTHONPATH=devcluster:dev python3 -m warmpool_devcluster.node_holder --suite-cluster NAME
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from warmpool_dev.paths import cache_root

from warmpool_devcluster.processes import alive

#: The demo's cluster (`warmpool demo`, `make demo`), which stays up for exploring after it ran.
DEMO_CLUSTER = "demo"
#: The command that stops it and everything the demo made.
DEMO_STOP = "make demo-down"
#: The cluster record each cluster's state directory holds (cluster.py writes it).
RECORD = "cluster.json"


def clusters_root() -> Path:
    return cache_root() / "clusters"


def _record(directory: Path) -> dict[str, object] | None:
    try:
        data = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pids(record: dict[str, object]) -> list[int]:
    """Every pid the record names: the control plane's and the node's."""
    found: list[int] = []
    node = record.get("node")
    for table in (record.get("pids"), node.get("pids") if isinstance(node, dict) else None):
        if isinstance(table, dict):
            found += [pid for pid in table.values() if isinstance(pid, int)]
    return found


def holders(root: Path, excluding: str | None = None) -> list[str]:
    """Names of the clusters under ``root`` (but ``excluding``) that have a real node and a process
    still running, sorted."""
    if not root.is_dir():
        return []
    found = []
    for directory in sorted(root.iterdir()):
        record = _record(directory) if directory.name != excluding else None
        if record is not None and record.get("node") and any(alive(pid) for pid in _pids(record)):
            found.append(directory.name)
    return found


def stop_command(name: str) -> str:
    """What a user runs to stop cluster ``name`` and free the real node."""
    return DEMO_STOP if name == DEMO_CLUSTER else f".venv/bin/warmpool cluster down --name {name}"


def suite_refusal(root: Path, suite_cluster: str | None) -> str | None:
    """Why the test suite cannot have the real node, or None when it can.  ``suite_cluster`` is the
    cluster the suite runs on (WARMPOOL_TEST_CLUSTER): holding the node itself, it shares it."""
    taken = holders(root, excluding=suite_cluster or None)
    if not taken:
        return None
    name = taken[0]
    reuse = "" if name == DEMO_CLUSTER else f", or run the suite on it: WARMPOOL_TEST_CLUSTER={name} make test"
    return (f"cluster {name!r} runs this machine's one real node, which the test suite needs for a cluster of "
            f"its own; stop it first: {stop_command(name)}{reuse}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmpool_devcluster.node_holder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite-cluster", default="",
                        help="the cluster the suite runs on (WARMPOOL_TEST_CLUSTER), which may hold the node")
    args = parser.parse_args(argv)
    refusal = suite_refusal(clusters_root(), args.suite_cluster)
    if refusal is not None:
        print(f"make test: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
