"""The chart's values that point a release at the dev cluster: the checkout's locally built images
and the real node's pod network.  One place, for the demo, the tests and anyone installing the chart
by hand on a `cluster up --node-runtime containerd` cluster (`warmpool images list` gives the tags)."""

from __future__ import annotations

from typing import Any


def _split(tag: str) -> tuple[str, str]:
    repository, _, version = tag.rpartition(":")
    return repository, version


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
