"""What the real sidecar (a subprocess) passes on to the engine, over real sockets on loopback: the
engine stand-in records the exact request target it receives, and no encoding trick a hostile
client sends (dot segments, encoded dots and slashes, backslashes, path parameters, NUL, bad or
double escapes, absolute-form targets, case) gets it a path outside ``/v1/`` -- vLLM's dev-mode
``/sleep`` and ``/reset_prefix_cache`` among them.  Ordinary completions, streamed or not, still
pass, with their query strings as sent.

Requests go out through ``http.client``, which puts the target on the request line as given.
Every request has a timeout; only 127.0.0.1 is addressed.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.test_sidecar import SidecarProcess
from tests.support.path_recording_engine import PROBE_HEADER, STREAMED_PIECES, PathRecordingEngine
from tests.support.procs import HOST

pytestmark = pytest.mark.integration

TIMEOUT_S = 20.0
BUCKETS = ["--buckets", "8", "--prompts-per-bucket", "1", "--decode-tokens", "1"]


@dataclass(frozen=True)
class Case:
    target: str
    #: the sidecar's answer: 200 (passed on), 404 (not a /v1/ path), 400 (not one readable path)
    status: int
    #: what the engine must receive for it, exactly; None: nothing
    engine_target: str | None = None
    method: str = "GET"


CASES = [
    # dot segments, plain and encoded, in every case: all resolve to a path outside /v1/
    Case("/v1/../sleep", 404),
    Case("/v1/../sleep?level=1", 404, method="POST"),
    Case("/v1/%2e%2e/sleep", 404, method="POST"),
    Case("/v1/%2E%2e/sleep", 404),
    Case("/v1/.%2e/sleep", 404),
    Case("/v1/%2e%2e/%2e%2e/sleep", 404),
    Case("/v1/./../reset_prefix_cache", 404, method="POST"),
    Case("/v1/..", 404),
    Case("/v1/x/../../wake_up", 404, method="POST"),
    # encoded slashes: one decoding makes them separators, so "..%2f" is a dot segment
    Case("/v1/..%2fsleep", 404),
    Case("/v1/..%2Fwake_up", 404),
    Case("/v1%2f..%2fsleep", 404),
    Case("/v1%2F%2e%2e%2Fsleep", 404),
    # double slashes
    Case("/v1//../sleep", 404),
    Case("//v1/../sleep", 404),
    # case: engines route case-sensitively, and so does the sidecar
    Case("/V1/../sleep", 404),
    Case("/V1/models", 404),
    # absolute-form request targets: decided on their path
    Case("http://127.0.0.1/v1/../sleep", 404, method="POST"),
    Case("http://127.0.0.1/v1/%2e%2e/reset_prefix_cache", 404),
    # a fragment is not part of the path
    Case("/v1/../v1/../sleep#frag", 404),
    # what one decoding cannot make into a clean path: refused whole
    Case("/v1/%252e%252e/sleep", 400),
    Case("/v1/%25%32%65%25%32%65/sleep", 400),
    Case("/v1/..;/sleep", 400),
    Case("/v1/..%3b/sleep", 400),
    Case("/v1/..\\sleep", 400),
    Case("/v1/%5c..%5csleep", 400),
    Case("/v1/%5C..%5Csleep", 400),
    Case("/v1/%00/../../sleep", 400),
    Case("/v1/..%00/sleep", 400),
    Case("/v1/%zz/../../sleep", 400),
    Case("/v1/%2/../../sleep", 400),
    Case("/v1/../sleep%", 400),
    Case("/v1/%c0%ae%c0%ae/sleep", 400),
    Case("/v1/%ef%bc%8e%ef%bc%8e/sleep", 400),
    Case("/v1/x%3f/../../sleep", 400),
    Case("/v1/x%3F.%2e/sleep", 400),
    Case("/v1/..%23/sleep", 400),
    Case("/v1/..%20/sleep", 400),
    # the engine's own paths, asked for directly
    Case("/sleep", 404, method="POST"),
    Case("/reset_prefix_cache", 404, method="POST"),
    # /v1/ paths: passed on as decided, the query string exactly as sent
    Case("/v1/models", 200, "/v1/models"),
    Case("/v1/models?x=1&y=%2f%2e%2e/../z", 200, "/v1/models?x=1&y=%2f%2e%2e/../z"),
    Case("/v1/models/../models", 200, "/v1/models"),
    Case("/v1/./models", 200, "/v1/models"),
    Case("/v1//models", 200, "/v1/models"),
    Case("/v1/%6dodels", 200, "/v1/models"),
    Case("/v1/x/%2e%2e/models", 200, "/v1/models"),
    Case("/v1/x%2f..%2fmodels", 200, "/v1/models"),
    Case("/v1/models#frag", 200, "/v1/models"),
    Case("http://127.0.0.1:1/v1/models", 200, "/v1/models"),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[PathRecordingEngine]:
    recorder = PathRecordingEngine()
    try:
        yield recorder
    finally:
        recorder.close()


@pytest.fixture(scope="module")
def sidecar(engine: PathRecordingEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    process = SidecarProcess(engine.url, Path(tmp_path_factory.mktemp("sidecar")), *BUCKETS)
    try:
        yield process
    finally:
        process.close()


def _send(sidecar: SidecarProcess, method: str, target: str, probe: str, body: bytes | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    """``target`` on the request line exactly as given; the whole answer."""
    connection = http.client.HTTPConnection(HOST, sidecar.port, timeout=TIMEOUT_S)
    try:
        headers = {PROBE_HEADER: probe, "Content-Type": "application/json"}
        connection.request(method, target, body=body if body is not None else b"", headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.method} {c.target}" for c in CASES])
def test_only_the_decided_v1_path_reaches_the_engine(
    engine: PathRecordingEngine, sidecar: SidecarProcess, case: Case
) -> None:
    probe = f"{case.method} {case.target}"
    status, _, body = _send(sidecar, case.method, case.target, probe)
    received = [r.target for r in engine.received(probe)]
    assert all(target.startswith("/v1/") for target in received), received
    assert status == case.status, (status, body, received)
    assert received == ([case.engine_target] if case.engine_target is not None else []), received
    if case.status != 200:
        error = json.loads(body)["error"]
        assert error["type"] and error["message"], error


def test_completions_pass_streamed_and_not(engine: PathRecordingEngine, sidecar: SidecarProcess) -> None:
    request = {"model": "path-recorder", "prompt": "hello", "max_tokens": 3}
    status, _, body = _send(sidecar, "POST", "/v1/completions", "plain", json.dumps(request).encode())
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == "".join(STREAMED_PIECES)

    streamed = {**request, "stream": True}
    status, headers, body = _send(sidecar, "POST", "/v1/completions?trace=%2e", "streamed",
                                  json.dumps(streamed).encode())
    assert status == 200, body
    assert headers.get("Content-Type", "").startswith("text/event-stream"), headers
    events = [line.removeprefix(b"data: ") for line in body.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", body
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == list(STREAMED_PIECES)

    assert [r.target for r in engine.received("plain")] == ["/v1/completions"]
    assert [r.target for r in engine.received("streamed")] == ["/v1/completions?trace=%2e"]


def test_no_probe_ever_reached_a_path_outside_v1(engine: PathRecordingEngine, sidecar: SidecarProcess) -> None:
    """Across every request this module sent (whatever ran before): the engine saw /v1/ only."""
    for case in CASES[:3]:
        _send(sidecar, case.method, case.target, "last")
    assert engine.received("last") == []
    outside = [r for r in engine.probed() if not r.target.startswith("/v1/")]
    assert outside == []
