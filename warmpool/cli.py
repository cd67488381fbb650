"""The `warmpool` console script: a thin dispatcher to each part's own command line.

Every subcommand's module is imported only when it runs, so `warmpool worker serve`
pays for nothing but the worker (cold start is the product).  The developer tools
(`cluster`, `model`, `bench`, `demo`) live in packages the images do not ship: there the
subcommand says so instead of failing with a traceback.

Run as the process's own command line, it exits on SIGTERM from its first instruction: in a
container it is PID 1, and the kernel drops any signal PID 1 has no handler for, so a pod deleted
before its part installs a handler of its own (the operator's standby waiting for the leader Lease,
a worker still importing torch) ignored the kubelet's SIGTERM, went on (a standby then took the
Lease and acted) and took the whole grace period and a SIGKILL.  The parts that stop gracefully
(kopf, the workers' and the node agent's event loops) install their own handlers while they run.
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

#: subcommand -> (module with a `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "cluster": ("warmpool_devcluster.cli", "local cluster: build | host-packages | up | down | status | kubeconfig"),
    "images": ("warmpool_devcluster.images_cli", "the project's images, built here: build | load | list"),
    "worker": ("warmpool_worker.cli", "run a worker: serve (built-in engine) | sidecar (external engine)"),
    "operator": ("warmpool_operator.app.cli", "run the operator (kopf)"),
    "activator": ("warmpool_operator.activator.app", "hold the requests of scale-to-zero pools at zero, forward "
                  "them once a pod is warm (the chart's activator Deployment)"),
    "node-agent": ("warmpool_nodecache.agent_cli", "fill this node's model cache from object stores"),
    "model": ("warmpool_dev.model_fetch", "fetch: the small real test model (SmolLM2-135M) as safetensors | "
              "push: a model directory to an S3 store, with its manifest"),
    "bench": ("warmpool_bench.cli", "benchmarks: coldstart | scale | predict | wake | podstart | cache | "
              "tracing-imports | serve | zero | nodes; render: a results file again as Markdown"),
    "demo": ("warmpool_dev.demo", "the main job end to end on a local cluster"),
}

#: (subcommand, action) -> the module that owns that action, where it is not the subcommand's module.
ACTIONS: dict[tuple[str, str], str] = {
    ("model", "push"): "warmpool_nodecache.push",  # needs boto3 (the 'nodecache' extra), not the dev tools
}

#: Packages of the developer tools: in a source checkout's install, never in an image.
DEVELOPER_PACKAGES = frozenset({"warmpool_dev", "warmpool_devcluster", "warmpool_bench"})


#: Commands this module answers itself: -> one-line help.
BUILTINS: dict[str, str] = {"version": "print warmpool's version (also --version)"}


def _usage() -> str:
    commands = {**{name: help_text for name, (_, help_text) in SUBCOMMANDS.items()}, **BUILTINS}
    width = max(len(name) for name in commands)
    lines = ["usage: warmpool <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, help_text in commands.items()]
    return "\n".join(lines)


def _missing(module: str, error: ModuleNotFoundError) -> str:
    """Why a subcommand cannot run: its own package is absent, or something it imports is."""
    package = module.split(".")[0]
    if (error.name or "").split(".")[0] != package:
        return f"needs the Python module {error.name!r}, which is not installed ({error})"
    if package in DEVELOPER_PACKAGES:
        return (f"a developer tool, not in this install (its package {package} is not installed; the images "
                "ship only the operator and the worker): run it from a source checkout after "
                "`pip install -e '.[dev]'` (`make venv`)")
    return f"not available in this install (its package {package} is not installed)"


class StopRequested(SystemExit):
    """SIGTERM arrived before the running part had a handler of its own: stop where it stands."""


def _stop_requested(signum: int, frame: FrameType | None) -> None:
    raise StopRequested(0)


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: the process's own command line (the console script, ``python -m warmpool``),
    which alone sets the process's SIGTERM handler; a caller's in-process call leaves it alone."""
    if argv is None:
        signal.signal(signal.SIGTERM, _stop_requested)
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except StopRequested:
        print("warmpool: SIGTERM: stopped", file=sys.stderr)
        return 0


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("--version", "version"):
        from warmpool import __version__

        print(__version__)
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"warmpool: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    action = ACTIONS.get((args[0], args[1])) if len(args) > 1 else None
    name, rest = (action, args[2:]) if action else (entry[0], args[1:])
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        print(f"warmpool {args[0]}: {_missing(name, error)}", file=sys.stderr)
        return 2
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
