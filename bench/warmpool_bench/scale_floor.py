"""The floor of `warmpool bench scale`: the fastest way this machine's API server takes the same objects.

One process, server-side apply of every object over one pooled HTTP client (the project's own
``warmpool.kube`` client: ``kubernetes_asyncio`` over aiohttp, keep-alive connections), with a
bounded number of requests in flight.  The number is tuned to the server in the same run: a
short sweep over ``CONCURRENCY_SWEEP`` on a slice of the objects, fastest wins.  (The floor it
replaces was one ``kubectl apply --server-side`` of a YAML stream, which sends one object at a
time: the operator beat it 2.2x, so it measured kubectl, not the API server.)

The objects are what the operator's run makes for N WarmModels: the WarmModels themselves (the
operator's run creates them with the same function) and, per WarmModel, the children its own
builders render (control Secret, ConfigMap, Service, PDB, Deployment).  The floor is done when the
API server has answered every write; the Deployment controller's pods are not waited for (the
operator's Ready does not wait for them either, with ``minWarm: 0``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: Requests in flight tried when tuning the floor to the server (the API server's default
#: --max-mutating-requests-inflight is 200, far above what two cores serve).
CONCURRENCY_SWEEP = (4, 8, 16, 32, 64)
#: WarmModels whose objects each sweep point applies (x6 objects).
SWEEP_MODELS = 60
FIELD_MANAGER = "warmpool-bench-floor"
#: The paths of the kinds the floor writes (the operator's own builders produce these kinds).
_PATHS = {"WarmModel": "/apis/warmpool.dev/v1alpha1", "Deployment": "/apis/apps/v1",
          "PodDisruptionBudget": "/apis/policy/v1", "Service": "/api/v1", "ConfigMap": "/api/v1",
          "Secret": "/api/v1"}
_PLURALS = {"WarmModel": "warmmodels", "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
            "Service": "services", "ConfigMap": "configmaps", "Secret": "secrets"}


def object_path(obj: dict[str, Any]) -> str:
    kind, meta = str(obj["kind"]), obj["metadata"]
    if kind not in _PATHS:
        raise ValueError(f"the scale floor writes {sorted(_PATHS)}, not {kind!r}")
    return f"{_PATHS[kind]}/namespaces/{meta['namespace']}/{_PLURALS[kind]}/{meta['name']}"


def children(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator makes for one bench WarmModel, rendered by its own builders."""
    import secrets

    from warmpool_operator.api.types import parse_spec
    from warmpool_operator.model import Target
    from warmpool_operator.rules import builders

    meta = manifest["metadata"]
    target = Target(name=meta["name"], namespace=meta["namespace"], spec=parse_spec(manifest["spec"]))
    return [builders.build_control_secret(target, secrets.token_urlsafe(32)), builders.build_configmap(target),
            builders.build_service(target), builders.build_pdb(target), builders.build_deployment(target)]


def floor_objects(manifests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The WarmModels and every child the operator would make for them, each WarmModel first."""
    objects: list[dict[str, Any]] = []
    for manifest in manifests:
        objects.append(manifest)
        objects.extend(children(manifest))
    return objects


async def _apply_all(kubeconfig: Path, objects: Sequence[dict[str, Any]], concurrency: int,
                     progress: Callable[[int], None] | None) -> list[str]:
    from kubernetes_asyncio import client, config

    from warmpool.kube import APPLY_PATCH, KubeClient, KubeError

    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = concurrency  # one keep-alive connection per request in flight
    kube = KubeClient(client.ApiClient(configuration))
    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    done = 0

    async def apply(obj: dict[str, Any]) -> None:
        nonlocal done
        async with gate:
            try:
                await kube.request("PATCH", object_path(obj), body=obj, content_type=APPLY_PATCH,
                                   query={"fieldManager": FIELD_MANAGER, "force": "true"})
            except (KubeError, TimeoutError, OSError) as error:
                failures.append(f"{obj['kind']} {obj['metadata']['name']}: {error}")
            done += 1
            if progress is not None:
                progress(done)

    try:
        await asyncio.gather(*(apply(obj) for obj in objects))
    finally:
        await kube.close()
    return failures


def apply_all(kubeconfig: Path, objects: Sequence[dict[str, Any]], concurrency: int,
              progress: Callable[[int], None] | None = None) -> list[str]:
    """Server-side apply every object, at most ``concurrency`` at once; what failed, one line each
    (empty: all applied).  Each request is bounded in time by the client (30 s)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_apply_all(kubeconfig, objects, concurrency, progress))


def timed_apply(kubeconfig: Path, objects: Sequence[dict[str, Any]], concurrency: int,
                label: str = "") -> dict[str, Any]:
    """Apply and time it: {"objects", "concurrency", "s", "per_s"} and "error" when any write failed;
    progress on stderr every 10 s."""
    import sys

    started = last = time.monotonic()

    def progress(done: int) -> None:
        nonlocal last
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            print(f"[bench scale] {label}applied {done}/{len(objects)} objects", file=sys.stderr, flush=True)

    failures = apply_all(kubeconfig, objects, concurrency, progress)
    seconds = time.monotonic() - started
    point: dict[str, Any] = {"objects": len(objects), "concurrency": concurrency, "s": seconds,
                             "per_s": len(objects) / seconds if seconds > 0 else None}
    if failures:
        point["error"] = f"{len(failures)} of {len(objects)} writes failed, first: {failures[0]}"
    return point


def best_concurrency(sweep: Sequence[dict[str, Any]]) -> int:
    """The sweep point that applied fastest (failed points never win); the smallest on a tie."""
    good = [p for p in sweep if "error" not in p and p.get("per_s")]
    if not good:
        raise RuntimeError(f"every point of the floor's concurrency sweep failed: {json.dumps(list(sweep))[:1000]}")
    return int(max(good, key=lambda p: (p["per_s"], -p["concurrency"]))["concurrency"])
