"""The CRD's http.url and s3.endpoint grammar admits only URLs every reader parses: the node
agent's (``urlsplit`` and its port) and, for an endpoint, botocore's.  Curated cases, then a
bounded random search over URL-like strings (seeded, so a failure repeats)."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError
from warmpool_nodecache.http_exchange import parse_url
from warmpool_operator.api import types as api

pytestmark = pytest.mark.unit

URL = re.compile(api.HttpModelSource.model_fields["url"].metadata[-1].pattern)
ENDPOINT = re.compile(api.S3ModelSource.model_fields["endpoint"].metadata[-1].pattern)


def _parses_as_endpoint(text: str) -> bool:
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

    return bool(is_valid_endpoint_url(text) or is_valid_ipv6_endpoint_url(text))


@pytest.mark.parametrize("url", [
    "http://h:abc/m", "http://bad_host:1/m", "http://h:0/m", "http://h:65536/m", "http://h:99999",
    "http://user:pw@h/m", "http://[1:2]/m", "http://[::1/m", "http://h/m m", "http://h/\u00e9",
    "http://-h/m", "http://h-/m", "ftp://h/m", "http://:80/m", f"http://{'a' * 64}/m",
])
def test_urls_that_do_not_parse_are_refused(url: str) -> None:
    with pytest.raises(ValidationError):
        api.HttpModelSource(url=url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8080/models/m", "https://models.example.com/m?x=1", "http://[::1]:8333",
    "http://[fe80::1:2]/m", "http://[2001:db8::8a2e:370:7334]:65535/a/b", "http://h:1", "http://H-1.x/m",
])
def test_urls_that_parse_are_admitted(url: str) -> None:
    assert api.HttpModelSource(url=url).url == url
    parse_url(url)


def test_the_s3_endpoint_grammar_is_the_s3_clients() -> None:
    for endpoint in ("http://bad_host:1", "http://h:abc", "http://h/x", f"http://{'a.' * 130}b"):
        with pytest.raises(ValidationError):
            api.S3ModelSource(endpoint=endpoint, bucket="models", secret_ref=api.SecretRef(name="s"))
    for endpoint in ("http://127.0.0.1:8333", "https://s3.eu-west-1.amazonaws.com/", "http://[::1]:8333"):
        api.S3ModelSource(endpoint=endpoint, bucket="models", secret_ref=api.SecretRef(name="s"))
        assert _parses_as_endpoint(endpoint.rstrip("/")), endpoint


def test_every_admitted_url_of_a_random_search_parses() -> None:
    rng = random.Random(20250525)
    pieces = ["a", "Z", "0", "9", "-", ".", "_", ":", "[", "]", "::", "1", "f", "@", "%", "65535", "65536", "0"]
    admitted = 0
    for _ in range(20000):  # bounded: about a second
        host = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        port = rng.choice(["", ":", ":1", ":080", ":65535", ":65536", ":x", ":8333"])
        path = rng.choice(["", "/", "/m", "/a b", "/m?q=1#f", "/\x7f"])
        url = f"{rng.choice(['http', 'https'])}://{host}{port}{path}"
        if URL.fullmatch(url):
            admitted += 1
            parse_url(url)  # raises on a URL the agent cannot read
        if ENDPOINT.fullmatch(f"http://{host}{port}"):
            assert _parses_as_endpoint(f"http://{host}{port}"), f"http://{host}{port}"
    assert admitted > 500  # the search did reach the grammar
