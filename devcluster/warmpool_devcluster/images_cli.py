"""`warmpool images build | load | list`: the project's images, built here, loaded into the real node
or pushed to a registry (`build --registry R --push`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from warmpool_devcluster import cluster, docker_engine, images, images_push, node
from warmpool_devcluster.chart_values import image_set_flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmpool images", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    for action, help_text in (("build", "build the images (skipped when built for these inputs)"),
                              ("load", "build, then import into the real node's containerd what it lacks"),
                              ("list", "print each image's tag for this checkout")):
        one = sub.add_parser(action, help=help_text)
        one.add_argument("names", nargs="*", metavar="NAME", help=f"images ({', '.join(images.IMAGES)}; default: all)")
        one.add_argument("--repo", type=Path, default=Path.cwd(), help="the source checkout (default: here)")
        if action == "load":
            one.add_argument("--cluster", default="default", help="the cluster whose node gets them")
        if action in ("load", "list"):
            one.add_argument("--helm-set", action="store_true",
                             help="print the operator's and the worker's image as `helm --set` arguments "
                                  "(for `helm install ... $(warmpool images list --helm-set)`)")
        if action == "build":
            one.add_argument("--registry", metavar="HOST[:PORT][/PATH]",
                             help="also tag each image as HOST[:PORT][/PATH]/warmpool-NAME (the chart's "
                                  "image.repository and workerImage.repository), under its content tag and "
                                  "the chart's appVersion")
            one.add_argument("--push", action="store_true",
                             help="push those tags to the registry (needs --registry; TLS, or plain HTTP on "
                                  "loopback; credentials from `docker login`)")
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names = list(args.names) or None
    if args.action == "build" and args.push and not args.registry:
        parser.error("--push needs --registry HOST[:PORT][/PATH]: the registry to push to")
    if getattr(args, "helm_set", False) and names and not {"operator", "worker"} <= set(names):
        parser.error("--helm-set names the operator and the worker image: leave out NAME, or give both")
    try:
        if args.action == "list":
            found = images.tags(images.check_checkout(args.repo))
        elif args.action == "build" and args.registry:
            registry = images_push.parse_registry(args.registry)
            found = images_push.tag_and_push(args.repo, registry, names, push=args.push)
        elif args.action == "build":
            found = images.build(args.repo, names)
        else:
            found = {}
            for state in node.runtime_dirs(cluster.state_dir(args.cluster)):
                found = images.load(args.repo, state, names)
    except (images.ImageError, docker_engine.DockerError, RuntimeError) as error:
        print(f"warmpool images {args.action}: {error}", file=sys.stderr)
        return 1
    if getattr(args, "helm_set", False):
        print(" ".join(image_set_flags(found)))
        return 0
    for name, tag in found.items():
        print(f"{name}\t{tag}")
    return 0
