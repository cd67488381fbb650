"""The activator as a hostile tenant meets it (issue 40): one team's client, on loopback, tries
every way through the shared activator to another team's pool, and floods it, while the other
team's clients are served.

Real HTTP on loopback and real objects on a real API server (WarmModels with their uids, pods
whose status carries a loopback address each, NetworkPolicies and namespaces as the API server
validated them); the activator's watches are played by feeding it those objects, as in
tests/integration/test_activator.py (the API server refuses loopback addresses in an EndpointSlice).
Each client binds its own loopback address, so the activator sees it as the pod with that IP.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes_asyncio import config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.activator import proxy
from warmpool_operator.activator.callers import Callers
from warmpool_operator.activator.demand import Demand
from warmpool_operator.activator.limits import ByteBudget, ConnectionGuard
from warmpool_operator.activator.pools import NOT_A_POOL, Pools

from tests.integration.test_activator import owned_service, owner_reference
from warmpool.contract.api import API_GROUP_VERSION, KIND, PLURAL
from warmpool.contract.http import MAX_REQUEST_BODY_BYTES, WORKER_PORT_NAME
from warmpool.contract.pods import COMPONENT_WORKER, LABEL_COMPONENT
from warmpool.contract.zero import (
    ERROR_BODY_TOO_LARGE,
    ERROR_BUSY,
    ERROR_MISDIRECTED,
    ERROR_NOT_SERVING_API,
    ERROR_SLOW_CLIENT,
    LABEL_SERVICE_NAME,
    held_annotation,
)
from warmpool.kube import MERGE_PATCH, KubeClient

pytestmark = pytest.mark.integration

ME = "activator-tenancy-0"
TEAM_A_IP, TEAM_B_IP = "127.0.0.2", "127.0.0.3"
CLUSTER_IP_B = "10.96.7.7"


def _rss() -> int:
    """This process's resident set, in bytes (the activator runs in it)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Upstream:
    """Team B's worker pod: records every path it is sent, answers completions."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def any(self, request: web.Request) -> web.Response:
        self.paths.append(request.raw_path)
        if request.method == "POST" and request.path == "/v1/completions":
            body = await request.json()
            return web.json_response({"choices": [{"text": f"echo {body.get('prompt')}"}]})
        return web.json_response({"secret": "metrics, control, anything"})


class Teams:
    """Team A's and team B's namespaces on the API server; team B has a scale-to-zero pool."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        suffix = uuid.uuid4().hex[:6]
        self.ns_a, self.ns_b = f"team-a-{suffix}", f"team-b-{suffix}"
        self.pools, self.callers = Pools(), Callers()
        self.upstream = Upstream()
        self.runners: list[web.AppRunner] = []
        self.sessions: list[aiohttp.ClientSession] = []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        made: dict[str, Any] = await self.client.request("POST", path, body=body)
        return made

    async def pod(self, namespace: str, name: str, ip: str, labels: dict[str, str]) -> None:
        base = f"/api/v1/namespaces/{namespace}/pods"
        await self.create(base, {"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": name, "namespace": namespace, "labels": labels},
                                 "spec": {"containers": [{"name": "c", "image": "client:1"}]}})
        pod = await self.client.request("PATCH", f"{base}/{name}/status", content_type=MERGE_PATCH,
                                        body={"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
        self.callers.pod("ADDED", pod)

    async def setup(self, scale_to_zero: dict[str, Any], guard: ConnectionGuard | None = None,
                    budget: ByteBudget | None = None, body_timeout_s: float = 3.0) -> Teams:
        for ns in (self.ns_a, self.ns_b):
            made = await self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": ns, "labels": {"team": ns[:6]}}})
            self.callers.namespace("ADDED", made)
            # No controller makes it on this API server; pods cannot be created without it.
            await self.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                              {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        self.wm = await self.create(
            f"/apis/{API_GROUP_VERSION}/namespaces/{self.ns_b}/{PLURAL}",
            {"apiVersion": API_GROUP_VERSION, "kind": KIND, "metadata": {"name": "m", "namespace": self.ns_b},
             "spec": {"model": {"hostPath": {"path": "/models/m"}},
                      "pool": {"replicas": 0, "minWarm": 0, "scaleToZero": scale_to_zero}}})
        self.pools.warmmodel("ADDED", self.wm)
        self.pools.service("ADDED", owned_service(self.wm, "m", CLUSTER_IP_B))
        # The chart's worker policy, as team B's namespace has it: only its own pods reach the workers.
        policy = await self.create(
            f"/apis/networking.k8s.io/v1/namespaces/{self.ns_b}/networkpolicies",
            {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"name": "workers", "namespace": self.ns_b},
             "spec": {"podSelector": {"matchLabels": {LABEL_COMPONENT: COMPONENT_WORKER}},
                      "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": WORKER_PORT_NAME}]}]}})
        self.callers.network_policy("ADDED", policy)
        await self.pod(self.ns_a, "client", TEAM_A_IP, {"app": "client"})
        await self.pod(self.ns_b, "client", TEAM_B_IP, {"app": "client"})

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False)
        self.sessions.append(self.session)
        self.demand = Demand(self.client, ME)
        self.activator = proxy.Activator(self.pools, self.demand, self.session, callers=self.callers, guard=guard,
                                         budget=budget, body_timeout_s=body_timeout_s)
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.activator.handle)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        assert runner.server is not None
        factory = guard.protocol_factory(runner.server) if guard is not None else runner.server
        self.server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        pod_app = web.Application()
        pod_app.router.add_route("*", "/{path:.*}", self.upstream.any)
        pod_runner = web.AppRunner(pod_app)
        await pod_runner.setup()
        site = web.TCPSite(pod_runner, "127.0.0.1", 0)
        await site.start()
        self.pod_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.runners += [runner, pod_runner]
        return self

    def slice(self, name: str, owners: list[dict[str, Any]]) -> None:
        host, port = self.pod_url.removeprefix("http://").rsplit(":", 1)
        self.pools.endpoint_slice("MODIFIED", {
            "metadata": {"name": name, "namespace": self.ns_b, "labels": {LABEL_SERVICE_NAME: "m"},
                         "ownerReferences": owners},
            "ports": [{"name": "http", "port": int(port)}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": True}}]})

    def warm(self) -> None:
        self.slice("m-pods", [owner_reference(self.wm)])

    def client_of(self, ip: str) -> aiohttp.ClientSession:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, local_addr=(ip, 0)))
        self.sessions.append(session)
        return session

    async def held_annotation(self) -> str | None:
        wm = await self.client.request("GET", f"/apis/{API_GROUP_VERSION}/namespaces/{self.ns_b}/{PLURAL}/m")
        value = (wm["metadata"].get("annotations") or {}).get(held_annotation(ME))
        return None if value is None else str(value)

    async def close(self) -> None:
        if hasattr(self, "server"):
            self.server.close()
        for runner in self.runners:
            await runner.cleanup()
        for session in self.sessions:
            await session.close()
        if hasattr(self, "demand"):
            await self.demand.clear_all()


@pytest.fixture()
async def teams(api_server: ClusterHandle) -> AsyncIterator[Teams]:
    client = KubeClient(await config.new_client_from_config(config_file=str(Path(api_server.kubeconfig))))
    made = Teams(client)
    try:
        yield made
    finally:
        await made.close()
        await client.close()


async def _post(session: aiohttp.ClientSession, url: str, host: str, path: str = "/v1/completions",
                **kwargs: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    kwargs.setdefault("json", {"prompt": "hi"})
    async with session.post(url + path, headers={"Host": host, "Authorization": "Bearer team-a"},
                            timeout=aiohttp.ClientTimeout(total=20), **kwargs) as response:
        return response.status, await response.json(content_type=None), dict(response.headers)


async def test_another_teams_client_reaches_no_pool_through_the_activator_whatever_it_names(teams: Teams) -> None:
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 5, "maxHeldRequests": 2})
    team_a, team_b = teams.client_of(TEAM_A_IP), teams.client_of(TEAM_B_IP)
    # At zero: team A names team B's pool every way a Host can; nothing is held, nothing reaches a pod.
    for host in (CLUSTER_IP_B, f"m.{teams.ns_b}", f"m.{teams.ns_b}.svc.cluster.local", "m"):
        for _ in range(3):  # past team B's maxHeldRequests, had they been held
            status, body, _ = await _post(team_a, teams.url, host)
            assert status == 421, (host, body)
            assert body["error"] == {"message": NOT_A_POOL, "type": ERROR_MISDIRECTED, "code": 421}
    assert teams.activator.held_total() == 0 and await teams.held_annotation() is None
    # Warm: still nothing for team A, and team B's own client is served.
    teams.warm()
    status, body, _ = await _post(team_a, teams.url, f"m.{teams.ns_b}")
    assert status == 421 and teams.ns_b not in str(body) and "127.0.0" not in str(body)
    status, body, _ = await _post(team_b, teams.url, "m")
    assert status == 200 and body == {"choices": [{"text": "echo hi"}]}
    assert teams.upstream.paths == ["/v1/completions"]


def _raw_post(port: int, local: str, target: str, host: str) -> tuple[int, dict[str, Any]]:
    """A POST with the request target exactly as given (a client library would normalise it)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(local, 0))
    try:
        body = json.dumps({"prompt": "hi"}).encode()
        connection.putrequest("POST", target, skip_host=True, skip_accept_encoding=True)
        for name, value in (("Host", host), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))):
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


async def test_only_the_serving_api_is_forwarded_in_the_one_spelling_that_nothing_rewrites(teams: Teams) -> None:
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 5, "maxHeldRequests": 2})
    teams.warm()
    refused = ["/metrics", "/control/tier", "/control/sleep", "/sleep", "/v1", "/v1/", "/v1/../metrics",
               "/v1/./../control/tier", "/v1/%2e%2e/metrics", "/v1/%2E%2E/sleep", "/v1/..%2fmetrics",
               "/v1//completions", "/v1/completions/..", "/v1/.hidden", "/v1/a%00b", "/V1/completions",
               "/v1\\..\\metrics", "/v1/completions;x=..", "http://pod/v1/completions"]
    for path in refused:
        for host in ("m", CLUSTER_IP_B):
            status, body = await asyncio.to_thread(_raw_post, teams.port, TEAM_B_IP, path, host)
            assert status in (400, 404), (path, status, body)
            if status == 404:
                assert body["error"]["type"] == ERROR_NOT_SERVING_API, path
    assert teams.upstream.paths == [], f"a path reached the pod: {teams.upstream.paths}"
    # The serving API goes through byte for byte, query included.
    status, _ = await asyncio.to_thread(_raw_post, teams.port, TEAM_B_IP, "/v1/completions?x=%2e%2e%2Fy&z=1", "m")
    assert status == 200 and teams.upstream.paths == ["/v1/completions?x=%2e%2e%2Fy&z=1"]


async def test_a_pool_takes_its_pods_only_from_the_slice_its_warmmodel_owns(teams: Teams) -> None:
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 2, "maxHeldRequests": 5})
    team_b = teams.client_of(TEAM_B_IP)
    stranger = {**owner_reference(teams.wm), "uid": str(uuid.uuid4())}
    teams.slice("m-pods", [])  # the right name, no owner
    teams.slice("m-pods", [stranger])  # the right name, another owner
    teams.slice("evil-pods", [owner_reference(teams.wm)])  # the label and the owner, another name
    assert teams.pools.pool((teams.ns_b, "m")).pods == []
    status, body, _ = await _post(team_b, teams.url, "m")
    assert status == 503 and teams.upstream.paths == [], body
    teams.warm()
    status, _, _ = await _post(team_b, teams.url, "m")
    assert status == 200


async def test_oversized_bodies_are_refused_before_anything_is_held_and_bytes_are_bounded(teams: Teams) -> None:
    budget = ByteBudget(MAX_REQUEST_BODY_BYTES + MAX_REQUEST_BODY_BYTES // 2)
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 20, "maxHeldRequests": 5}, budget=budget)
    team_b = teams.client_of(TEAM_B_IP)
    large = b'{"prompt": "' + b"x" * (MAX_REQUEST_BODY_BYTES + 1) + b'"}'
    status, body, _ = await _post(team_b, teams.url, "m", json=None, data=large)
    assert status == 413 and body["error"]["type"] == ERROR_BODY_TOO_LARGE

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused once past the limit
        for _ in range(4):
            yield b"x" * (MAX_REQUEST_BODY_BYTES // 2)

    status, body, _ = await _post(team_b, teams.url, "m", json=None, data=chunked())
    assert status == 413 and body["error"]["type"] == ERROR_BODY_TOO_LARGE
    assert teams.activator.held_total() == 0 and await teams.held_annotation() is None and budget.used == 0
    # One body of the largest size held: a second does not fit the budget and is refused for now.
    big = b'{"prompt": "' + b"y" * (MAX_REQUEST_BODY_BYTES - 20) + b'"}'
    first = asyncio.create_task(_post(team_b, teams.url, "m", json=None, data=big))
    for _ in range(200):
        if teams.activator.held_total() == 1:
            break
        await asyncio.sleep(0.05)
    assert teams.activator.held_total() == 1
    status, body, headers = await _post(team_b, teams.url, "m", json=None, data=big)
    assert status == 503 and body["error"]["type"] == ERROR_BUSY and headers["Retry-After"].isdigit()
    teams.warm()
    status, _, _ = await first
    assert status == 200 and budget.used == 0


def _trickle(port: int, local: str) -> socket.socket:
    """A connection that sends half a request head and then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(local, 0))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: m\r\nX-Slow: ")
    return sock


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, TimeoutError):
        return True


async def test_slow_connections_and_oversized_bodies_do_not_exhaust_the_activator(teams: Teams) -> None:
    guard = ConnectionGuard(max_connections=260, header_timeout_s=3.0)
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 60, "maxHeldRequests": 20}, guard=guard)
    team_b = teams.client_of(TEAM_B_IP)
    rss_before = _rss()
    # Well-behaved held requests first, then the attack beside them.
    held = [asyncio.create_task(_post(team_b, teams.url, "m", json={"prompt": f"p{i}"})) for i in range(5)]
    slow = await asyncio.gather(*(asyncio.to_thread(_trickle, teams.port, TEAM_A_IP) for _ in range(200)))
    large = b'{"prompt": "' + b"z" * (4 * MAX_REQUEST_BODY_BYTES) + b'"}'
    oversized = await asyncio.gather(*(_post(team_b, teams.url, "m", json=None, data=large) for _ in range(50)))
    assert {status for status, _, _ in oversized} == {413}
    # Past the connection bound: 503 with Retry-After at once, nothing read.
    extra = [await asyncio.to_thread(_trickle, teams.port, TEAM_A_IP) for _ in range(60)]
    answers = [await asyncio.to_thread(s.recv, 4096) for s in extra if guard.refused]
    assert guard.refused >= 1 and any(a.startswith(b"HTTP/1.1 503") and b"Retry-After" in a for a in answers)
    # The trickling connections are closed at the header deadline.
    assert all(await asyncio.gather(*(asyncio.to_thread(_closed, s) for s in slow)))
    assert guard.timed_out >= 200
    grown = _rss() - rss_before
    teams.warm()
    results = await asyncio.gather(*held)
    assert [status for status, _, _ in results] == [200] * 5
    assert sorted(body["choices"][0]["text"] for _, body, _ in results) == [f"echo p{i}" for i in range(5)]
    for sock in slow + extra:
        sock.close()
    # 50 bodies of 4 MiB read whole would be 200 MiB; refused unread, they cost next to nothing.
    print(f"\n200 trickling connections, 50 bodies of 4 MiB, {guard.refused} refused at the bound: the process grew "
          f"{grown / 2**20:.1f} MiB; {guard.timed_out} connections closed at the header deadline")
    assert grown < 64 * 1024 * 1024, f"the attack grew the process by {grown / 2**20:.0f} MiB"


def _trickle_body(port: int, local: str, trickle_s: float) -> tuple[int | None, dict[str, Any], float]:
    """A POST whose head arrives whole and whose body then comes a byte every 0.2 s, never all of it:
    the status and body of the answer, and the seconds it took (None: no answer within ``trickle_s``
    of trickling and 3 s more)."""
    body = json.dumps({"prompt": "x" * 200}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3, source_address=(local, 0))
    try:
        connection.putrequest("POST", "/v1/completions", skip_host=True, skip_accept_encoding=True)
        for name, value in (("Host", "m"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))):
            connection.putheader(name, value)
        connection.endheaders()
        sock = connection.sock
        started = time.monotonic()
        for byte in body[:-1]:  # never the last byte: only the deadline can end the read
            if time.monotonic() - started > trickle_s or select.select([sock], [], [], 0.2)[0]:
                break  # an answer came (or the trickle ran its course)
            sock.sendall(bytes([byte]))
        try:
            response = connection.getresponse()
        except TimeoutError:
            return None, {}, time.monotonic() - started
        return response.status, json.loads(response.read() or b"{}"), time.monotonic() - started
    finally:
        connection.close()


async def test_a_body_trickled_past_the_body_timeout_is_408_and_nothing_is_held(teams: Teams) -> None:
    """A client that sends its request head at once and then its body a byte at a time would keep a
    connection (and whatever it had sent) for as long as it likes: the body has ``--body-timeout``."""
    await teams.setup({"afterIdleSeconds": 60, "holdTimeoutSeconds": 30, "maxHeldRequests": 5}, body_timeout_s=1.0)
    status, body, took = await asyncio.to_thread(_trickle_body, teams.port, TEAM_B_IP, 6.0)
    assert status == 408, f"a body trickled for {took:.1f}s: {status} {body}"
    assert body["error"]["type"] == ERROR_SLOW_CLIENT and body["error"]["code"] == 408
    assert 1.0 <= took < 6.0, f"408 after {took:.1f}s with a 1s body timeout"  # within the trickle: its deadline
    assert teams.activator.held_total() == 0 and await teams.held_annotation() is None
    assert teams.activator.budget.used == 0 and teams.upstream.paths == []
    # The pool's own clients are served as before.
    teams.warm()
    status, answer, _ = await _post(teams.client_of(TEAM_B_IP), teams.url, "m")
    assert status == 200 and answer == {"choices": [{"text": "echo hi"}]}
