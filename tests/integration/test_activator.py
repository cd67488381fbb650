"""The activator's data path (operator/warmpool_operator/activator/): real HTTP on loopback (the
activator's own aiohttp server, a pod played by an aiohttp server), and its held counts written to
a WarmModel on a real API server.  The pools are fed the watch events the real watches would bring
(the API server refuses loopback addresses in an EndpointSlice; the watches themselves run in the
real-node test, tests/e2e/test_e2e_zero.py).  The tenancy checks (who may reach which pool, what is
forwarded, the bounds) are in tests/integration/test_activator_tenancy.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes_asyncio import config
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.activator import app as activator_app
from warmpool_operator.activator import proxy
from warmpool_operator.activator.demand import Demand
from warmpool_operator.activator.limits import RETRY_AFTER_SECONDS
from warmpool_operator.activator.pools import NOT_A_POOL, Misdirected, Pools
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.rules.builders import service_name

from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.pods import LABEL_MODEL
from warmpool.contract.telemetry import ATTR_OUTCOME, ATTR_WARMMODEL, SPAN_FORWARD, SPAN_HELD_REQUEST, SPAN_HOLD
from warmpool.contract.zero import (
    ERROR_HOLD_FULL,
    ERROR_HOLD_TIMEOUT,
    LABEL_SERVICE_NAME,
    held_annotation,
    held_value,
    read_held,
)
from warmpool.kube import KubeClient

pytestmark = pytest.mark.integration

CLUSTER_IP = "10.96.0.42"
ME = "activator-test-0"


class Upstream:
    """A worker pod: /v1/completions answers JSON, or server-sent events when asked to stream."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.release = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"body": body, "host": request.host, "x-test": request.headers.get("X-Test"),
                          "traceparent": request.headers.get("traceparent")})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"echo {body['prompt']}"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "first"}]}\n\n')
        await self.release.wait()  # the test reads the first event before the rest is sent
        await response.write(b'data: {"choices": [{"text": "second"}]}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response


def owner_reference(wm: dict[str, Any]) -> dict[str, Any]:
    """The owner reference the operator puts on a WarmModel's children."""
    return {"apiVersion": API_GROUP_VERSION, "kind": KIND, "name": wm["metadata"]["name"],
            "uid": wm["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def owned_service(wm: dict[str, Any], name: str, cluster_ip: str, owned: bool = True) -> dict[str, Any]:
    """A WarmModel's Service as its watch event brings it (owned, unless said otherwise)."""
    meta: dict[str, Any] = {"name": name, "namespace": wm["metadata"]["namespace"],
                            "labels": {LABEL_MODEL: wm["metadata"]["name"]}}
    if owned:
        meta["ownerReferences"] = [owner_reference(wm)]
    return {"metadata": meta, "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip]}}


async def _serve(app: web.Application, **options: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, **options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


class Rig:
    """One WarmModel on the API server, the activator serving on loopback, and its upstream pod."""

    def __init__(self, client: KubeClient, namespace: str) -> None:
        self.client, self.namespace = client, namespace
        self.pools = Pools()
        self.demand = Demand(client, ME)
        self.upstream = Upstream()
        self.runners: list[web.AppRunner] = []

    async def start(self, scale_to_zero: dict[str, Any], tracing: Tracing | None = None,
                    **activator_options: Any) -> Rig:
        body = {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": "m", "namespace": self.namespace},
                "spec": {"model": {"hostPath": {"path": "/models/m"}},
                         "pool": {"replicas": 0, "minWarm": 0, "scaleToZero": scale_to_zero}}}
        self.wm = await self.client.request("POST", self._path(), body=body)
        self.pools.warmmodel("ADDED", self.wm)
        self.pools.service("ADDED", owned_service(self.wm, "m", CLUSTER_IP))
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False)
        self.activator = proxy.Activator(self.pools, self.demand, self.session, tracing=tracing, **activator_options)
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.activator.handle)
        runner, self.url = await _serve(app, handler_cancellation=True)
        pod_app = web.Application()
        pod_app.router.add_post("/v1/completions", self.upstream.completions)
        pod_runner, self.pod_url = await _serve(pod_app)
        self.runners += [runner, pod_runner]
        return self

    def _path(self, name: str = "") -> str:
        return f"/apis/{API_GROUP_VERSION}/namespaces/{self.namespace}/{PLURAL}" + (f"/{name}" if name else "")

    def pods_slice(self, urls: list[str]) -> None:
        """The operator's pods slice of the Service, as its watch event would bring it."""
        host_port = [u.removeprefix("http://").rsplit(":", 1) for u in urls]
        self.pools.endpoint_slice("MODIFIED", {
            "metadata": {"name": "m-pods", "namespace": self.namespace, "labels": {LABEL_SERVICE_NAME: "m"},
                         "ownerReferences": [owner_reference(self.wm)]},
            "ports": [{"name": "http", "port": int(host_port[0][1]) if host_port else 8000}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": True}} for host, _ in host_port]})

    async def held_on_server(self) -> int | None:
        parsed = await self.held_value_on_server()
        return None if parsed is None else parsed[0]

    async def held_value_on_server(self) -> tuple[int, float, str | None] | None:
        wm = await self.client.request("GET", self._path("m"))
        value = (wm["metadata"].get("annotations") or {}).get(held_annotation(ME))
        return None if value is None else read_held(value)

    async def wait(self, check: Any, what: str, within: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + within
        while not await check():
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    def post(self, prompt: str = "hi", stream: bool = False, host: str = CLUSTER_IP,
             traceparent: str | None = None) -> Any:
        headers = {"Host": host, "X-Test": "kept", **({"traceparent": traceparent} if traceparent else {})}
        return self.session.post(self.url + "/v1/completions", json={"prompt": prompt, "stream": stream},
                                 headers=headers)

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        await self.session.close()
        await self.demand.clear_all()


@pytest.fixture()
async def rig(api_server: ClusterHandle) -> AsyncIterator[Rig]:
    client = KubeClient(await config.new_client_from_config(config_file=str(Path(api_server.kubeconfig))))
    namespace = f"act-{uuid.uuid4().hex[:8]}"
    await client.request("POST", "/api/v1/namespaces",
                         body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    made = Rig(client, namespace)
    try:
        yield made
    finally:
        await made.close()
        await client.close()


def _warmmodel(namespace: str, name: str, scale_to_zero: bool = True) -> dict[str, Any]:
    pool: dict[str, Any] = {"scaleToZero": {"afterIdleSeconds": 60}} if scale_to_zero else {}
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
            "spec": {"pool": pool}}


def test_a_request_is_resolved_by_the_services_cluster_ip_or_dns_name_and_refused_alike_otherwise() -> None:
    pools = Pools()
    for namespace in ("team-a", "team-b"):
        wm = _warmmodel(namespace, "chat")
        pools.warmmodel("ADDED", wm)
        pools.service("ADDED", owned_service(wm, "chat", f"10.96.0.{len(namespace)}"))
    solo = _warmmodel("team-a", "solo")
    pools.warmmodel("ADDED", solo)
    pools.service("ADDED", owned_service(solo, "solo", "10.96.1.1"))
    plain = _warmmodel("team-a", "plain", scale_to_zero=False)
    pools.warmmodel("ADDED", plain)
    pools.service("ADDED", owned_service(plain, "plain", "10.96.1.2"))
    # A Service anyone could make: the model's label, but no owner reference to the WarmModel.
    pools.service("ADDED", owned_service(_warmmodel("team-a", "chat"), "forged", "10.96.1.3", owned=False))
    assert pools.resolve("10.96.1.1:8000", None) == ("team-a", "solo")
    assert pools.resolve("chat.team-b", "team-a") == ("team-b", "chat")
    assert pools.resolve("CHAT.team-a.svc.cluster.local:80", None) == ("team-a", "chat")
    # A bare name is looked up in the caller's own namespace, as cluster DNS would.
    assert pools.resolve("chat", "team-b") == ("team-b", "chat")
    assert pools.resolve("solo", "team-a") == ("team-a", "solo")
    refused = ["chat", "solo.team-b", "chat.team-c", "10.96.9.9", "", "plain.team-a", "10.96.1.3",
               "forged.team-a"]
    answers = set()
    for host in refused:
        with pytest.raises(Misdirected) as raised:
            pools.resolve(host, None if host == "chat" else "team-a")
        answers.add(str(raised.value))
    # One answer for every refusal: it names no namespace, Service or reason a stranger could map.
    assert answers == {NOT_A_POOL}
    assert "team-" not in NOT_A_POOL
    # A Service deleted: its name and address name nothing any more.
    pools.service("DELETED", owned_service(solo, "solo", "10.96.1.1"))
    with pytest.raises(Misdirected):
        pools.resolve("10.96.1.1", None)


def test_a_service_named_and_labelled_as_the_operator_makes_it_counts_only_when_its_warmmodel_owns_it() -> None:
    """Anyone who may create Services in a namespace can make one with the WarmModel's own name and
    label: unowned, or owned by something else, it names no pool, by name or by its ClusterIP."""
    pools = Pools()
    for namespace in ("team-a", "team-b", "team-c"):
        pools.warmmodel("ADDED", _warmmodel(namespace, "chat"))
    stranger = _warmmodel("team-c", "stranger")  # another object's uid in the owner reference
    pools.service("ADDED", owned_service(_warmmodel("team-a", "chat"), service_name("chat"), "10.96.2.1"))
    pools.service("ADDED", owned_service(_warmmodel("team-b", "chat"), service_name("chat"), "10.96.2.2", owned=False))
    forged = owned_service(_warmmodel("team-c", "chat"), service_name("chat"), "10.96.2.3", owned=False)
    forged["metadata"]["ownerReferences"] = [owner_reference(stranger)]
    pools.service("ADDED", forged)
    assert pools.resolve("chat.team-a", None) == ("team-a", "chat")  # the same Service, owned: a pool
    for namespace, ip in (("team-b", "10.96.2.2"), ("team-c", "10.96.2.3")):
        for host, caller in ((ip, None), (f"chat.{namespace}", None), ("chat", namespace),
                             (f"chat.{namespace}.svc.cluster.local", "team-a")):
            with pytest.raises(Misdirected) as raised:
                pools.resolve(host, caller)
            assert str(raised.value) == NOT_A_POOL, host


async def test_readyz_answers_readiness_only() -> None:
    """/readyz is open to whatever probes the pod: it names no namespace, pod address or held pool
    (those are in the metrics, whose port the chart restricts), only whether this replica is ready."""
    synced, stopping = [asyncio.Event(), asyncio.Event()], asyncio.Event()
    runner, url = await _serve(await activator_app._health_app(synced, stopping))
    try:
        async with aiohttp.ClientSession() as session:
            async def readyz() -> tuple[int, Any]:
                async with session.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=10)) as response:
                    return response.status, await response.json()

            assert await readyz() == (503, {"ready": False})  # a watch has not listed yet
            synced[0].set()
            assert await readyz() == (503, {"ready": False})
            synced[1].set()
            assert await readyz() == (200, {"ready": True})
            stopping.set()
            assert await readyz() == (503, {"ready": False})
    finally:
        await runner.cleanup()


async def test_a_held_request_is_counted_on_the_warmmodel_and_forwarded_once_a_pod_is_warm(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5})
    waiting = asyncio.create_task(rig.post("held"))

    async def counted() -> bool:
        return await rig.held_on_server() == 1

    await rig.wait(counted, "the held count on the WarmModel")
    assert not waiting.done() and rig.activator.held_total() == 1
    rig.pods_slice([rig.pod_url])
    async with await waiting as response:
        assert response.status == 200
        assert await response.json() == {"choices": [{"text": "echo held"}]}
    # The request went on as it came (its own headers kept, the pod's address as Host).
    assert rig.upstream.seen[-1]["x-test"] == "kept" and rig.upstream.seen[-1]["host"] != CLUSTER_IP

    async def removed() -> bool:
        return await rig.held_on_server() is None

    await rig.wait(removed, "the held annotation removed once nothing is held")


async def test_with_tracing_on_the_hold_is_written_beside_its_count_and_never_carries_the_clients_trace(
        rig: Rig) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5},
                    tracing=Tracing(provider.get_tracer("test"), provider))
    client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    waiting = asyncio.create_task(rig.post("traced", traceparent=f"00-{client_trace}-{client_span}-01"))
    written: list[str] = []

    async def traced() -> bool:
        parsed = await rig.held_value_on_server()
        if parsed is not None and parsed[2] is not None:
            written.append(parsed[2])
        return bool(written)

    await rig.wait(traced, "the held count and the hold's traceparent on the WarmModel")
    rig.pods_slice([rig.pod_url])
    async with await waiting as response:
        assert response.status == 200
    _, hold_trace, hold_span, _ = written[0].split("-")
    _, forward_trace, forward_span, _ = str(rig.upstream.seen[-1]["traceparent"]).split("-")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {SPAN_HELD_REQUEST, SPAN_HOLD, SPAN_FORWARD}
    ids = {name: (f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for name, s in spans.items()}
    parents = {name: f"{s.parent.span_id:016x}" if s.parent else None for name, s in spans.items()}
    # The request's own spans are the client's trace: held_request under the client's span, the
    # forward under it, and the pod's side of the answer joins it (the client's header replaced).
    assert ids[SPAN_HELD_REQUEST][0] == ids[SPAN_FORWARD][0] == client_trace == forward_trace
    assert parents[SPAN_HELD_REQUEST] == client_span and parents[SPAN_FORWARD] == ids[SPAN_HELD_REQUEST][1]
    assert ids[SPAN_FORWARD][1] == forward_span
    # What the operator reads (and may stamp on a pod template) is never the client's trace: the hold
    # is the root of a trace of the activator's own, linked to the request it holds.
    assert hold_trace != client_trace and parents[SPAN_HOLD] is None
    assert ids[SPAN_HOLD] == (hold_trace, hold_span)
    assert [f"{link.context.span_id:016x}" for link in spans[SPAN_HOLD].links] == [ids[SPAN_HELD_REQUEST][1]]
    assert (spans[SPAN_HELD_REQUEST].attributes or {})[ATTR_OUTCOME] == 200
    assert (spans[SPAN_HELD_REQUEST].attributes or {})[ATTR_WARMMODEL] == f"{rig.namespace}/m"


async def test_past_max_held_requests_is_429_with_retry_after_and_past_the_hold_timeout_503(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 2, "maxHeldRequests": 2})
    first = [asyncio.create_task(rig.post(f"p{i}")) for i in range(2)]

    async def both_held() -> bool:
        return rig.activator.held_total() == 2

    await rig.wait(both_held, "two requests held")
    async with rig.post("one too many") as response:
        assert response.status == 429 and response.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
        error = (await response.json())["error"]
        assert error["type"] == ERROR_HOLD_FULL and "maxHeldRequests" in error["message"]
    for task in first:
        async with await task as response:
            assert response.status == 503
            error = (await response.json())["error"]
            assert error["type"] == ERROR_HOLD_TIMEOUT and f"{rig.namespace}/m" in error["message"]
            assert "holdTimeoutSeconds" in error["message"] and "wake or start" in error["message"]
    assert rig.activator.held_total() == 0 and rig.upstream.seen == []


async def test_a_client_that_hangs_up_is_dropped_from_the_hold(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5})
    waiting = asyncio.create_task(rig.post("gone"))

    async def held() -> bool:
        return rig.activator.held_total() == 1

    await rig.wait(held, "the request held")
    waiting.cancel()  # the client closes its connection

    async def dropped() -> bool:
        return rig.activator.held_total() == 0

    await rig.wait(dropped, "the hung-up request dropped from the hold")
    rig.pods_slice([rig.pod_url])
    await asyncio.sleep(0.2)
    assert rig.upstream.seen == [], "a request whose client left was forwarded anyway"


async def test_a_streamed_answer_passes_through_as_it_comes(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5})
    rig.pods_slice([rig.pod_url])
    async with rig.post("stream", stream=True) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "first"
        rig.upstream.release.set()
        rest = await asyncio.wait_for(response.content.read(), 5)
    assert rest.endswith(b"data: [DONE]\n\n") and b"second" in rest


async def test_a_pod_that_refuses_is_skipped_for_the_next_and_none_left_is_502(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5})
    # One slice has one port: the same port on another loopback address, where nothing listens.
    dead = rig.pod_url.replace("127.0.0.1", "127.0.0.2")
    rig.pods_slice([dead, rig.pod_url])
    for _ in range(2):  # round robin starts on either
        async with rig.post("either") as response:
            assert response.status == 200
    rig.pods_slice([dead])
    async with rig.post("none") as response:
        message = (await response.json())["error"]["message"]
        assert response.status == 502 and "no pod took the request" in message
        assert "127.0.0" not in message, "the 502 named a pod's address"


async def test_a_count_left_by_this_replicas_previous_container_is_removed(rig: Rig) -> None:
    await rig.start({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5})
    wm = await rig.client.request("PATCH", rig._path("m"), body={"metadata": {"annotations": {
        held_annotation(ME): held_value(3, 1_800_000_000), held_annotation("other-replica"): held_value(1, 1)}}},
        content_type="application/merge-patch+json")
    rig.demand.adopt((rig.namespace, "m"), wm["metadata"]["annotations"])

    async def removed() -> bool:
        return await rig.held_on_server() is None

    await rig.wait(removed, "the previous container's count removed")
    wm = await rig.client.request("GET", rig._path("m"))
    assert held_annotation("other-replica") in wm["metadata"]["annotations"], "another replica's count was touched"
