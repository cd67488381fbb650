"""What the operator's control-layer tests share, whichever API server they run against (the
in-memory one of fake_api.py, or a real one with no controllers, api_world.py):

* :class:`TestKube`: the operator's :class:`~warmpool_operator.io.kube.Kube` as such a test holds
  it: every call the operator makes recorded, a fault injected per (method, plural) raised by the
  next such call, and the test's own edits and reads (someone else's, by hand) never recorded;
* :class:`ControlCluster`: one namespace of the server, the operator's watch indexes over it
  (refreshed by ``watch``), and the Deployment controller and kubelet (``run_pods``);
* :class:`FakeWorkers`: the :class:`~warmpool_operator.io.worker_client.WorkerClient` of pods that
  exist only as the metrics they report, recording every control call sent to them;
* :class:`Clock`: the time the operator reads (``Shared.monotonic`` / ``Shared.wall``);
* :func:`capture_events`: kopf's own event queue, read instead of posted.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kopf
from kopf._core.engines import posting
from warmpool_operator.io.kube import Kube
from warmpool_operator.io.watch_cache import (
    MANAGED,
    POD_SPEC_READ,
    REPLICASET_SPEC_READ,
    Cache,
    model_key,
    slim,
    slim_worker,
)
from warmpool_operator.io.worker_client import WorkerClient
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Obj, Sample

from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.http import CONTROL_FIELD_SLEEP_LEVEL, PATH_CONTROL_SLEEP, PATH_CONTROL_WAKE
from warmpool.contract.metrics import (
    METRIC_MEMORY_USED_RATIO,
    METRIC_READY,
    METRIC_REQUESTS_IN_FLIGHT,
    METRIC_REQUESTS_TOTAL,
    METRIC_SLEEP_CAPABLE,
    METRIC_SLEEP_LEVEL,
)
from warmpool.kube import KubeError

#: An API path in a namespace: its group prefix, namespace, plural, and name and subresource if any.
PATH = re.compile(r"^(?P<prefix>/api/v1|/apis/[^/]+/[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
                  r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")
#: The child kinds the operator watches, by the plural of their API path.
CHILD_KINDS = {"Deployment": "deployments", "Service": "services", "ConfigMap": "configmaps",
               "PodDisruptionBudget": "poddisruptionbudgets", "EndpointSlice": "endpointslices",
               "NetworkPolicy": "networkpolicies"}


@dataclass
class Call:
    method: str
    plural: str
    name: str | None
    subresource: str | None
    body: Any


class TestKube(Kube, abc.ABC):
    """The operator's client with the test's bookkeeping (see the module docstring)."""

    __test__ = False  # not a test class, whatever its name says

    def __init__(self, api_client: Any) -> None:
        super().__init__(api_client)
        self.calls: list[Call] = []
        #: (method, plural) -> the KubeError the next such call raises
        self.faults: dict[tuple[str, str], KubeError] = {}

    def writes(self, plural: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.method != "GET" and (plural is None or c.plural == plural)]

    def record(self, method: str, plural: str, name: str | None, subresource: str | None, body: Any) -> None:
        """Note an operator call, and raise the fault injected for it, if any."""
        self.calls.append(Call(method, plural, name, subresource, body))
        fault = self.faults.pop((method, plural), None)
        if fault is not None:
            raise fault

    @abc.abstractmethod
    async def put(self, plural: str, obj: Mapping[str, Any]) -> Obj:
        """The test's own write: create the object (or, with a resourceVersion, replace it), then
        its status when it has one, as the kubelet or a controller would write it."""

    @abc.abstractmethod
    async def get_obj(self, plural: str, namespace: str, name: str) -> Obj | None:
        """The test's own read: the object as stored, or None."""

    @abc.abstractmethod
    async def delete_obj(self, plural: str, namespace: str, name: str) -> None:
        """The test's own delete."""


class ControlCluster(abc.ABC):
    """One namespace of the API server, the operator's watch indexes over it, and the Deployment
    controller and kubelet the tests play (``run_pods``)."""

    kube: TestKube

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.children: dict[str, dict[Any, list[Obj]]] = {kind: {} for kind in CHILD_KINDS}
        self.replicasets: dict[Any, list[Obj]] = {}
        self.pods: dict[Any, list[Obj]] = {}
        # Plain dicts of lists stand in for kopf's indexes (a mapping of key -> stored values).
        self.cache = Cache(children=self.children, replicasets=self.replicasets,  # type: ignore[arg-type]
                           pods=self.pods)  # type: ignore[arg-type]

    @abc.abstractmethod
    async def watch(self) -> None:
        """The indexes refreshed to what the operator's label-filtered watches would show now."""

    async def close(self) -> None:
        await self.kube.close()

    def index(self, objects: Iterable[Obj]) -> None:
        """The indexes refreshed in place to ``objects`` (each naming its kind, as a watch event does)."""
        managed = [o for o in objects
                   if all(((o.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in MANAGED.items())]
        for kind, index in self.children.items():
            index.clear()
            for obj in managed:
                if obj.get("kind") == kind:
                    index[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = [slim(obj)]
        # Trimmed as the operator's own indexes trim them (app/handlers.py), so the passes are tested
        # on what they will hold.
        for kind, model_index, spec_read in (("ReplicaSet", self.replicasets, REPLICASET_SPEC_READ),
                                             ("Pod", self.pods, POD_SPEC_READ)):
            model_index.clear()
            for obj in managed:
                key = model_key(obj["metadata"]["namespace"], obj["metadata"].get("labels") or {})
                if obj.get("kind") == kind and key is not None:
                    model_index.setdefault(key, []).append(slim_worker(obj, spec_read))

    async def warmmodel(self, name: str, spec: Mapping[str, Any]) -> Obj:
        return await self.kube.put(PLURAL, {
            "apiVersion": API_GROUP_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": self.namespace}, "spec": dict(spec)})

    async def run_pods(self, name: str, ips: list[str], node: str = "node-1") -> list[Obj]:
        """A ReplicaSet of the Deployment's template, and one Running, Ready pod of it per IP."""
        deployment = await self.kube.get_obj("deployments", self.namespace, name)
        assert deployment is not None, "no Deployment to run pods of"
        replicaset = await self.kube.put("replicasets", replicaset_of(deployment, len(ips)))
        pods = [await self.kube.put("pods", pod) for pod in pods_of(deployment, replicaset, ips, node)]
        await self.watch()
        return [{**pod, "kind": "Pod", "apiVersion": "v1"} for pod in pods]


def replicaset_of(deployment: Obj, replicas: int) -> Obj:
    """The ReplicaSet the Deployment controller would make of ``deployment``."""
    meta, template = deployment["metadata"], deployment["spec"]["template"]
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"], "uid": meta["uid"],
             "controller": True}
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
        "name": f"{meta['name']}-rs", "namespace": meta["namespace"], "labels": dict(template["metadata"]["labels"]),
        "ownerReferences": [owner]},
        "spec": {"replicas": replicas, "selector": deployment["spec"]["selector"], "template": template}}


def pods_of(deployment: Obj, replicaset: Obj, ips: list[str], node: str) -> list[Obj]:
    """A pod of the template per IP, owned by ``replicaset``, bound to ``node``, Running and Ready
    at that IP (the status as the kubelet would write it)."""
    meta, template = deployment["metadata"], deployment["spec"]["template"]
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replicaset["metadata"]["name"],
             "uid": replicaset["metadata"]["uid"], "controller": True}
    return [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{meta['name']}-{i}", "namespace": meta["namespace"],
                     "labels": dict(template["metadata"]["labels"]),
                     "annotations": dict(template["metadata"].get("annotations") or {}), "ownerReferences": [owner]},
        "spec": {**template["spec"], "nodeName": node},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                   "conditions": [{"type": "Ready", "status": "True"}]},
    } for i, ip in enumerate(ips)]


@dataclass
class Worker:
    """What one fake worker pod reports on /metrics."""

    used_ratio: float | None = 0.5
    ready: bool = True
    sleep_level: int = 0
    sleep_capable: bool = True
    requests_total: float = 0.0
    in_flight: float = 0.0

    def text(self) -> str:
        lines = [f"{METRIC_READY} {1 if self.ready else 0}",
                 f"{METRIC_SLEEP_LEVEL} {self.sleep_level}",
                 f"{METRIC_SLEEP_CAPABLE} {1 if self.sleep_capable else 0}",
                 f"{METRIC_REQUESTS_TOTAL} {self.requests_total}",
                 f"{METRIC_REQUESTS_IN_FLIGHT} {self.in_flight}"]
        if self.used_ratio is not None:
            lines.append(f'{METRIC_MEMORY_USED_RATIO}{{source="test"}} {self.used_ratio}')
        return "\n".join(lines) + "\n"


@dataclass
class Posted:
    ip: str
    path: str
    token: str
    body: Mapping[str, object]


class FakeWorkers(WorkerClient):
    """Worker pods by IP, as their /metrics say; every control call recorded and obeyed (a sleep
    sets the worker's level, a wake clears it)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(session=_NO_SESSION, timeout=1.0)
        self.clock = clock
        self.pods: dict[str, Worker] = {}
        self.posted: list[Posted] = []
        #: path -> the error a control call to it returns (None: it succeeds)
        self.refuse: dict[str, str] = {}
        self.scrapes = 0

    async def metrics(self, url: str) -> Sample:
        self.scrapes += 1
        worker = self.pods.get(str(urlsplit(url).hostname))
        if worker is None:
            return Sample(error="unreachable: ClientConnectorError")
        sample = parse_metrics(worker.text())
        sample.sent_at = self.clock()
        return sample

    async def post(self, url: str, token: str, body: Mapping[str, object], limit: float) -> str | None:
        parts = urlsplit(url)
        ip = str(parts.hostname)
        self.posted.append(Posted(ip, parts.path, token, dict(body)))
        if parts.path in self.refuse:
            return self.refuse[parts.path]
        worker = self.pods.get(ip)
        if worker is not None and parts.path == PATH_CONTROL_SLEEP:
            worker.sleep_level = int(str(body[CONTROL_FIELD_SLEEP_LEVEL]))
        elif worker is not None and parts.path == PATH_CONTROL_WAKE:
            worker.sleep_level = 0
        return None

    def sent(self, path: str) -> list[Posted]:
        return [p for p in self.posted if p.path == path]


#: A session the fake never uses (its calls are overridden); typed as the real one.
_NO_SESSION: aiohttp.ClientSession = None  # type: ignore[assignment]


@dataclass
class Clock:
    """A clock a test moves by hand."""

    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Events:
    """The Events the operator posted, read off kopf's own queue."""

    queue: asyncio.Queue[posting.K8sEvent] = field(default_factory=asyncio.Queue)
    seen: list[posting.K8sEvent] = field(default_factory=list)

    def reasons(self) -> list[str]:
        while not self.queue.empty():
            self.seen.append(self.queue.get_nowait())
        return [event.reason for event in self.seen]


def capture_events() -> Events:
    """Route kopf.event() into a queue this test reads (kopf's posting context, as the operator
    sets it up when it runs); call it inside the test's own coroutine."""
    events = Events()
    settings = kopf.OperatorSettings()
    settings.posting.enabled = True
    posting.settings_var.set(settings)
    posting.event_queue_var.set(events.queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return events
