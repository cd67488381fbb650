"""The chart's values that point a release at the dev cluster: the checkout's locally built images
and the real node's pod network.  One place, for the demo, the tests and anyone installing the chart
by hand on a `cluster up --node-runtime containerd` cluster (`warmpool images list` gives the tags)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: For renders that start no pod (tests of the chart's objects, the monitors a Prometheus is given):
#: the chart requires image repositories (no registry publishes warmpool's), and these are ones no
#: registry serves (``.invalid`` never resolves).
RENDER_ONLY_IMAGES: dict[str, dict[str, str]] = {
    "image": {"repository": "warmpool.invalid/warmpool-operator"},
    "workerImage": {"repository": "warmpool.invalid/warmpool-worker"},
}


def render_only_values(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``values`` with `RENDER_ONLY_IMAGES` wherever they name no image of their own."""
    out = dict(values or {})
    for key, default in RENDER_ONLY_IMAGES.items():
        out[key] = {**default, **(out.get(key) or {})}
    return out


def render_only_set_flags() -> list[str]:
    """`RENDER_ONLY_IMAGES` as ``helm --set`` arguments."""
    return [arg for key, image in RENDER_ONLY_IMAGES.items()
            for arg in ("--set", f"{key}.repository={image['repository']}")]


def _split(tag: str) -> tuple[str, str]:
    repository, _, version = tag.rpartition(":")
    return repository, version


def image_set_flags(images: dict[str, str]) -> list[str]:
    """``helm --set`` arguments naming the operator and worker images ``images`` gives (name -> tag),
    as `local_values` does (`warmpool images list --helm-set`)."""
    values = local_values(images, "")
    return [arg for key in ("image", "workerImage") for field in ("repository", "tag")
            for arg in ("--set", f"{key}.{field}={values[key][field]}")]


def local_values(images: dict[str, str], pod_cidr: str) -> dict[str, Any]:
    """Values for ``helm install``: the operator and worker images as loaded on the node (never
    pulled: IfNotPresent and tags no registry serves), and scraping limited to the node's pods."""
    operator_repo, operator_tag = _split(images["operator"])
    worker_repo, worker_tag = _split(images["worker"])
    return {
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "IfNotPresent"},
        "workerImage": {"repository": worker_repo, "tag": worker_tag},
        "operator": {"scrapeNetworks": [pod_cidr]},
    }
