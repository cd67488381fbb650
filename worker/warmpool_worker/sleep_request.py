"""What a ``/control/sleep`` request asks for: the level, from a JSON body or a query, checked
the same way by the built-in worker and the sidecar (a 400 naming the field otherwise)."""

from __future__ import annotations

import json

from aiohttp import web
from warmpool_worker.http_app import BadRequest

from warmpool.contract.http import CONTROL_FIELD_SLEEP_LEVEL, SLEEP_LEVELS
from warmpool.contract.numerals import ascii_int_or_none, shown


def parse_level(raw: object) -> int:
    """A sleep level from a body or a query (1 or 2), or a 400 naming the field."""
    level = ascii_int_or_none(raw, max(SLEEP_LEVELS)) if isinstance(raw, str) else raw
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        raise BadRequest(400, f"{CONTROL_FIELD_SLEEP_LEVEL} must be one of {list(SLEEP_LEVELS)}, got {shown(raw)}",
                         param=CONTROL_FIELD_SLEEP_LEVEL)
    return level


async def requested_level(request: web.Request) -> int:
    """The level a ``/control/sleep`` body asks for (1 when the body is empty, as vLLM does),
    or a 400 naming what is wrong; the worker and the sidecar both read it here."""
    try:
        body = await request.json() if request.can_read_body else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(400, f"malformed JSON body: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    return parse_level(body.get(CONTROL_FIELD_SLEEP_LEVEL, 1))
