"""The sidecar's decision on which path reaches the engine (:mod:`warmpool_worker.sidecar.engine_path`):
decoded once, dot segments resolved, refused unless under /v1/, and the decided path its own
encoding, so neither the HTTP client nor the engine can read it as another path.

The same over real sockets, through the sidecar process: tests/integration/test_sidecar_paths.py.
"""

from __future__ import annotations

import posixpath
import random
import urllib.parse

import pytest
from warmpool_worker.http_app import BadRequest
from warmpool_worker.sidecar.engine_path import engine_path, engine_target, percent_decoded, resolved
from yarl import URL

pytestmark = pytest.mark.unit

ENGINE = "http://127.0.0.1:8000"

PASSED = [
    ("/v1/completions", "/v1/completions"),
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/models/../completions", "/v1/completions"),
    ("/v1/./models", "/v1/models"),
    ("/v1//models", "/v1/models"),
    ("/v1/%6dodels", "/v1/models"),
    ("/v1/x/%2e%2e/models", "/v1/models"),
    ("/v1/x%2F..%2Fmodels", "/v1/models"),
    ("/v1/models/org%2Fname", "/v1/models/org/name"),
    ("/v1/models/a:b@c~d_e-f.g!$&'()*+,=", "/v1/models/a:b@c~d_e-f.g!$&'()*+,="),
    ("/v1/models/...", "/v1/models/..."),
    ("/v1/completions/", "/v1/completions/"),
    ("/v1/", "/v1/"),
    ("/v1/.", "/v1/"),
    ("/v1/x/..", "/v1/"),
    ("/../v1/models", "/v1/models"),  # ".." at the root stays there (RFC 3986 5.2.4)
]

NOT_UNDER_V1 = [
    ("/v1/../sleep", "/sleep"),
    ("/v1/%2e%2e/sleep", "/sleep"),
    ("/v1/%2E%2e/sleep", "/sleep"),
    ("/v1/.%2E/sleep", "/sleep"),
    ("/v1/./../reset_prefix_cache", "/reset_prefix_cache"),
    ("/v1/..%2fsleep", "/sleep"),
    ("/v1/..%2Fwake_up", "/wake_up"),
    ("/v1%2f..%2fsleep", "/sleep"),
    ("/v1//../sleep", "/sleep"),
    ("//v1/../sleep", "/sleep"),
    ("/v1/x/../../sleep", "/sleep"),
    ("/v1/..", "/"),
    ("/v1", "/v1"),
    ("/V1/models", "/V1/models"),
    ("/sleep", "/sleep"),
    ("/v1models", "/v1models"),
]

UNREADABLE = [
    ("/v1/%252e%252e/sleep", "'%'"),  # encoded twice: a second decoding would make it ".."
    ("/v1/..;/sleep", "';'"),
    ("/v1/..%3B/sleep", "';'"),
    ("/v1/..\\sleep", "'\\\\'"),
    ("/v1/%5c..%5csleep", "'\\\\'"),
    ("/v1/%00", "the byte 0x00"),
    ("/v1/..%0a/sleep", "the byte 0x0A"),
    ("/v1/%7f", "the byte 0x7F"),
    ("/v1/a%20b", "the byte 0x20"),
    ("/v1/x%3f/../../sleep", "'?'"),
    ("/v1/..%23/sleep", "'#'"),
    ("/v1/%c0%ae%c0%ae/sleep", "the byte 0xC0"),  # an overlong "." in UTF-8
    ("/v1/%ef%bc%8e%ef%bc%8e/sleep", "the byte 0xEF"),  # fullwidth full stops
    ("/v1/\u00e9", "not ASCII"),
    ("/v1/%zz", "malformed percent escape at character 4"),
    ("/v1/%2", "malformed percent escape at character 4"),
    ("/v1/%", "malformed percent escape at character 4"),
    ("/v1/%%32%65", "malformed percent escape at character 4"),
]


@pytest.mark.parametrize(("raw", "decided"), PASSED)
def test_a_v1_path_is_passed_on_decoded_and_resolved(raw: str, decided: str) -> None:
    assert engine_path(raw) == decided


@pytest.mark.parametrize(("raw", "resolved_to"), NOT_UNDER_V1)
def test_a_path_that_resolves_outside_v1_is_a_404_naming_it(raw: str, resolved_to: str) -> None:
    with pytest.raises(BadRequest) as refused:
        engine_path(raw)
    assert refused.value.status == 404
    assert f"is {resolved_to!r} once decoded and resolved" in refused.value.message
    assert refused.value.kind == "invalid_request_error"


@pytest.mark.parametrize(("raw", "named"), UNREADABLE)
def test_a_path_one_decoding_cannot_make_clean_is_a_400_naming_why(raw: str, named: str) -> None:
    with pytest.raises(BadRequest) as refused:
        engine_path(raw)
    assert refused.value.status == 400
    assert named in refused.value.message, refused.value.message


def test_the_query_string_passes_exactly_as_sent() -> None:
    assert engine_target("/v1/models", "") == "/v1/models"
    assert engine_target("/v1/x/../models", "a=%2f&b=../c&c=%zz") == "/v1/models?a=%2f&b=../c&c=%zz"
    with pytest.raises(BadRequest):
        engine_target("/v1/../sleep", "level=1")


def test_a_long_refused_path_is_quoted_short() -> None:
    with pytest.raises(BadRequest) as refused:
        engine_path("/v1/../" + "x" * 5000)
    assert len(refused.value.message) < 600


def _assert_nothing_reads_it_as_another_path(decided: str) -> None:
    """A second decoding, the client's URL parsing and a server's normalisation all leave it be."""
    assert decided.startswith("/v1/"), decided
    assert resolved(percent_decoded(decided)) == decided
    assert urllib.parse.unquote(decided) == decided
    assert URL(ENGINE + decided, encoded=True).raw_path == decided
    assert URL(ENGINE + decided).raw_path == decided  # even a client that parses and normalises
    assert URL(ENGINE + decided).path == decided
    assert posixpath.normpath(decided).startswith("/v1")


@pytest.mark.parametrize(("raw", "decided"), PASSED)
def test_a_decided_path_is_its_own_encoding(raw: str, decided: str) -> None:
    _assert_nothing_reads_it_as_another_path(engine_path(raw))


#: The pieces a hostile path is made of.
PIECES = ["/", "/", "v1", "V1", ".", "..", "%2e", "%2E", "%2e%2e", "%2f", "%2F", "%5c", "\\", ";", "%3b", "%00",
          "%25", "%", "%3f", "%23", "//", "sleep", "models", "a", "%c0%ae", "%41", "~", ":"]


def test_no_path_built_from_tricks_decides_outside_v1() -> None:
    """A bounded, seeded search over paths made of the pieces above: each is refused or decides
    a /v1/ path that nothing downstream reads as another."""
    rng = random.Random(40)
    passed = refused = 0
    for _ in range(5000):
        raw = "/v1/" + "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8)))
        try:
            decided = engine_path(raw)
        except BadRequest as error:
            assert error.status in (400, 404), (raw, error.status)
            refused += 1
            continue
        _assert_nothing_reads_it_as_another_path(decided)
        passed += 1
    assert passed > 100 and refused > 100, (passed, refused)  # the search reached both sides
