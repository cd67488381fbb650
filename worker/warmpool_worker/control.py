"""``POST /control/tier``: the operator's directive to the local tier guard, for both modes.

``{"tier": "truncated", "ttl_seconds": 60}`` with ``Authorization: Bearer <token>``; the
token is read from a file (a mounted Secret) on each call, so a rotated Secret takes effect
without a restart.  Without a token file the endpoint refuses every call (403).  The answer
is the guard's state after the directive (the effective tier is the stricter of the local
one and the directive's; `guard.TierGuard`).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from warmpool_worker.guard import TierGuard
from warmpool_worker.http_app import BadRequest

from warmpool.contract.api import DEFAULT_DIRECTIVE_TTL_SECONDS, DIRECTIVE_TIERS, MAX_DIRECTIVE_TTL_SECONDS, Tier
from warmpool.contract.http import (
    CONTROL_FIELD_TIER,
    CONTROL_FIELD_TRACEPARENT,
    CONTROL_FIELD_TTL,
    CONTROL_TOKEN_HEADER,
    PATH_CONTROL_TIER,
)
from warmpool.contract.telemetry import valid_traceparent

if TYPE_CHECKING:
    from warmpool_worker.tracing import TraceSink

log = logging.getLogger(__name__)


class ControlEndpoint:
    """The control handler one guard answers to; `mount` it on an app (serve and sidecar do)."""

    def __init__(self, guard: TierGuard, token_file: Path | None, traces: TraceSink | None = None) -> None:
        self.guard = guard
        self.token_file = token_file
        self.traces = traces  # tracing on: a directive that changes the tier is a span in its sender's trace

    def mount(self, app: web.Application) -> None:
        app.router.add_post(PATH_CONTROL_TIER, self.control_tier)

    def check_token(self, request: web.Request) -> None:
        """Raise 403 without a token file or on a wrong token, 401 without a bearer token."""
        if self.token_file is None:
            raise BadRequest(
                403, "control endpoint disabled: the worker has no --control-token-file", "forbidden"
            )
        header = request.headers.get(CONTROL_TOKEN_HEADER, "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise BadRequest(
                401, f"missing bearer token in the {CONTROL_TOKEN_HEADER} header", "unauthorized"
            )
        try:
            expected = self.token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            log.error("cannot read control token file %s: %s", self.token_file, error)
            raise BadRequest(403, "control token unavailable on the worker", "forbidden") from None
        if not expected or not hmac.compare_digest(presented.strip().encode(), expected.encode()):
            raise BadRequest(403, "wrong bearer token", "forbidden")

    async def control_tier(self, request: web.Request) -> web.Response:
        self.check_token(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequest(400, f"malformed JSON body: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        names = [t.value for t in DIRECTIVE_TIERS]
        raw_tier = body.get(CONTROL_FIELD_TIER)
        if raw_tier not in names:
            raise BadRequest(
                400, f"{CONTROL_FIELD_TIER} must be one of {names}, got {raw_tier!r}", param="tier"
            )
        ttl = body.get(CONTROL_FIELD_TTL, DEFAULT_DIRECTIVE_TTL_SECONDS)
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not 0 < ttl <= MAX_DIRECTIVE_TTL_SECONDS
        ):
            raise BadRequest(
                400,
                f"{CONTROL_FIELD_TTL} must be a number within "
                f"(0, {MAX_DIRECTIVE_TTL_SECONDS:g}], got {ttl!r}",
                param=CONTROL_FIELD_TTL,
            )
        traceparent = body.get(CONTROL_FIELD_TRACEPARENT)
        if traceparent is not None and not valid_traceparent(traceparent):
            raise BadRequest(400, f"{CONTROL_FIELD_TRACEPARENT} must be a W3C traceparent "
                             f"(00-<32 hex>-<16 hex>-<2 hex>), got {traceparent!r}",
                             param=CONTROL_FIELD_TRACEPARENT)
        before = self.guard.state
        started = time.time()
        state = self.guard.set_directive(Tier(raw_tier), float(ttl))
        if self.traces is not None and isinstance(traceparent, str) and before.directive is not state.directive:
            self.traces.directive(traceparent, state.effective.value, before.effective.value, started, time.time())
        return web.json_response(state.describe())
