"""Which request path the sidecar passes on to the engine, decided once on the path as the engine
will read it.

The engine listens on the pod's loopback and serves, beside ``/v1/``, what must not be reachable
from outside the pod (vLLM's dev-mode ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, without
authentication).  A check on the path as received is not enough: ``/v1/../sleep``,
``/v1/%2e%2e/sleep`` or ``/v1/..%2Fsleep`` start with ``/v1/`` and still name ``/sleep`` once
decoded and resolved, by the sidecar's HTTP client or by the engine.  So the raw path is
percent-decoded exactly once and its dot segments resolved (RFC 3986 5.2.4), that result is the
decision, and it is what the engine receives.

The decided path holds only characters that stand for themselves in a URL path (letters, digits
and ``-._~!$&'()*+,=:@``), so it is its own encoding: no client or engine can decode it into
something else.  Anything else after the one decoding is refused with a 400 naming it: a ``%``
(a path encoded twice, which a second decoding would change), ``\\`` (a separator to some
servers), ``;`` (path parameters, which some servers strip: ``..;/``), ``?`` and ``#`` (the query
and fragment, encoded into the path), NUL and other control bytes, spaces, and non-ASCII bytes
(overlong or look-alike dots).  A percent sign not followed by two hex digits is refused too.
Paths the OpenAI API uses need none of them.
"""

from __future__ import annotations

import string

from warmpool_worker.http_app import BadRequest

#: The only paths passed on: the OpenAI-compatible API (case-sensitive, as the engines route).
FORWARDED_PREFIX = "/v1/"
#: RFC 3986 ``pchar`` less ``%`` (encodings) and ``;`` (path parameters): characters that mean
#: themselves in a path, to every server.
_PATH_PUNCTUATION = "-._~!$&'()*+,=:@"
PATH_CHARACTERS = frozenset(string.ascii_letters + string.digits + _PATH_PUNCTUATION)
_HEX = frozenset(string.hexdigits)
#: How much of a refused path an error message quotes back.
_QUOTED_CHARS = 200


def _quoted(raw_path: str) -> str:
    return raw_path if len(raw_path) <= _QUOTED_CHARS else raw_path[:_QUOTED_CHARS] + "..."


def _named(byte: int) -> str:
    return repr(chr(byte)) if 0x20 < byte < 0x7F else f"the byte 0x{byte:02X}"


def percent_decoded(raw_path: str) -> str:
    """``raw_path`` with every ``%XX`` replaced by its byte, once; a malformed escape is a 400."""
    if not raw_path.isascii():
        raise BadRequest(400, f"the request path {_quoted(raw_path)!r} is not ASCII: percent-encode it")
    decoded = bytearray()
    index = 0
    while index < len(raw_path):
        char = raw_path[index]
        if char != "%":
            decoded.append(ord(char))
            index += 1
            continue
        escape = raw_path[index + 1:index + 3]
        if len(escape) != 2 or not set(escape) <= _HEX:
            raise BadRequest(400, f"the request path {_quoted(raw_path)!r} has a malformed percent escape "
                                  f"at character {index}: '%' must be followed by two hex digits")
        decoded.append(int(escape, 16))
        index += 3
    for byte in decoded:
        if chr(byte) not in PATH_CHARACTERS and chr(byte) != "/":
            raise BadRequest(400, f"the request path {_quoted(raw_path)!r} holds {_named(byte)} once "
                                  "percent-decoded: a path passed to the engine may hold only letters, digits, "
                                  f"'/' and {_PATH_PUNCTUATION}")
    return decoded.decode("ascii")


def resolved(path: str) -> str:
    """``path`` with its ``.`` and ``..`` segments resolved (RFC 3986 5.2.4: ``..`` at the root
    stays at the root) and its empty ones (``//``) dropped, so that no server reads it otherwise;
    a trailing ``/`` kept where the path ends in a directory."""
    segments: list[str] = []
    parts = path.split("/")
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if segments:
                segments.pop()
            continue
        segments.append(part)
    directory = parts[-1] in ("", ".", "..") and bool(segments)
    return "/" + "/".join(segments) + ("/" if directory else "")


def engine_path(raw_path: str) -> str:
    """The path to send the engine for a request whose raw (as received) path is ``raw_path``.

    BadRequest: 400 when the path cannot be read as one path, 404 when it does not name a
    ``/v1/`` path once decoded and resolved.
    """
    path = resolved(percent_decoded(raw_path))
    if not path.startswith(FORWARDED_PREFIX):
        raise BadRequest(404, f"the request path {_quoted(raw_path)!r} is {_quoted(path)!r} once decoded and resolved: "
                              f"only {FORWARDED_PREFIX} paths are passed on to the engine")
    return path


def engine_target(raw_path: str, raw_query: str) -> str:
    """The request target (path and query) to send the engine: :func:`engine_path`, and the
    query string exactly as received (it cannot change the path)."""
    path = engine_path(raw_path)
    return f"{path}?{raw_query}" if raw_query else path
