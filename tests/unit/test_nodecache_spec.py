"""spec.model -> a fill Source, and the S3 key rules that refuse an escaping key before
any request (no store is needed: building a source makes no request)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_nodecache.s3 import (
    S3Credentials,
    S3KeyError,
    S3Source,
    credentials_from_env,
    credentials_from_file,
    parse_s3_url,
)
from warmpool_nodecache.source import HttpSource, SourceError
from warmpool_nodecache.spec import (
    SourceSpecError,
    credentials_from_secret_data,
    secret_ref_name,
    source_from_spec,
    source_kind,
)

from warmpool.contract.files import S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY

pytestmark = pytest.mark.unit

CREDS = S3Credentials("AKIDEXAMPLE", "s3cr3t-value")
S3 = {"endpoint": "http://127.0.0.1:1", "bucket": "models", "prefix": "smol/r1/", "secretRef": "models-s3"}


def test_http_spec_builds_an_http_source() -> None:
    source = source_from_spec({"http": {"url": "http://127.0.0.1:1/models/x"}})
    assert isinstance(source, HttpSource)
    assert source.describe() == "http://127.0.0.1:1/models/x"


def test_s3_spec_builds_an_s3_source_with_a_normalised_prefix() -> None:
    source = source_from_spec({"s3": S3}, credentials=CREDS)
    assert isinstance(source, S3Source)
    assert source.describe() == "s3://models/smol/r1"
    assert source.key("model.safetensors") == "smol/r1/model.safetensors"
    assert source.config.credentials == CREDS
    assert "s3cr3t" not in repr(source.config)


@pytest.mark.parametrize("ref", ["models-s3", {"name": "models-s3"}])
def test_secret_ref_is_a_name_or_an_object_with_one(ref: object) -> None:
    assert secret_ref_name({"s3": {**S3, "secretRef": ref}}) == "models-s3"


def test_s3_without_secret_ref_is_unsigned_and_with_one_needs_credentials() -> None:
    unsigned = {k: v for k, v in S3.items() if k != "secretRef"}
    source = source_from_spec({"s3": unsigned})
    assert isinstance(source, S3Source) and source.config.credentials is None
    with pytest.raises(SourceSpecError, match="Secret 'models-s3'"):
        source_from_spec({"s3": S3})


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"pvc": {"claimName": "x"}}, "no http or s3 source"),
        ({"http": {"url": "x"}, "s3": S3}, "both http and s3"),
        ({"s3": {**S3, "bucket": ""}}, r"s3\.bucket must be a non-empty string"),
        ({"s3": {k: v for k, v in S3.items() if k != "endpoint"}}, r"s3\.endpoint"),
        ({"http": {}}, r"http\.url"),
        ({"s3": "models"}, "must be an object"),
        ({"s3": {**S3, "secretRef": {"name": ""}}}, "secretRef must name a Secret"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, object], match: str) -> None:
    with pytest.raises(SourceSpecError, match=match):
        source_from_spec(spec, credentials=CREDS)


def test_source_kind() -> None:
    assert source_kind({"s3": S3}) == "s3"
    assert source_kind({"http": {"url": "http://127.0.0.1"}}) == "http"
    assert source_kind({"hostPath": {"path": "/x"}}) is None


@pytest.mark.parametrize("prefix", ["../other", "a/../../b", "/abs", "a//b", "a\\b"])
def test_an_escaping_prefix_is_refused_before_any_request(prefix: str) -> None:
    with pytest.raises(S3KeyError):
        source_from_spec({"s3": {**S3, "prefix": prefix}}, credentials=CREDS)


@pytest.mark.parametrize("path", ["../secret", "a/../../b", "/etc/passwd", "./x", "a\\..\\b", ""])
def test_an_escaping_object_path_is_refused_before_any_request(path: str) -> None:
    # The endpoint is a closed port: had a request been made the error would be a connection failure.
    source = source_from_spec({"s3": S3}, credentials=CREDS)
    with pytest.raises(S3KeyError, match=r"refused|normalised|absolute"):
        source.fetch_range(path, 0, 10)
    with pytest.raises(S3KeyError):
        source.size(path)


def test_secret_data_decodes_base64_and_names_a_missing_key() -> None:
    data = {S3_SECRET_ACCESS_KEY_ID_KEY: base64.b64encode(b"AKID").decode(),
            S3_SECRET_SECRET_ACCESS_KEY_KEY: base64.b64encode(b"shh\n").decode()}
    assert credentials_from_secret_data(data) == S3Credentials("AKID", "shh")
    with pytest.raises(SourceSpecError, match=S3_SECRET_SECRET_ACCESS_KEY_KEY):
        credentials_from_secret_data({S3_SECRET_ACCESS_KEY_ID_KEY: data[S3_SECRET_ACCESS_KEY_ID_KEY]}, "Secret x")
    with pytest.raises(SourceSpecError, match="not base64"):
        credentials_from_secret_data({**data, S3_SECRET_ACCESS_KEY_ID_KEY: "%%%"})


def test_s3_urls() -> None:
    assert parse_s3_url("s3://models/smol/r1/") == ("models", "smol/r1")
    assert parse_s3_url("s3://models") == ("models", "")
    for bad in ("http://x/y", "s3:///x", "s3://b/../x"):
        with pytest.raises(SourceError):
            parse_s3_url(bad)


def test_credentials_from_env_and_file(tmp_path: Path) -> None:
    assert credentials_from_env({}) is None
    assert credentials_from_env({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}) == S3Credentials("k", "s")
    with pytest.raises(SourceError, match="both"):
        credentials_from_env({"AWS_ACCESS_KEY_ID": "k"})
    path = tmp_path / "credentials"
    path.write_text("[default]\naws_access_key_id = k\naws_secret_access_key = s\n")
    assert credentials_from_file(path) == S3Credentials("k", "s")
    path.write_text("[other]\naws_access_key_id = k\n")
    with pytest.raises(SourceError, match=r"no \[default\] section"):
        credentials_from_file(path)
    with pytest.raises(SourceError, match="No such file"):
        credentials_from_file(tmp_path / "absent")


def _without_boto3(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where importing boto3 fails, as in an install without the extra."""
    prelude = "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def test_the_core_and_the_http_source_need_no_boto3_and_s3_says_how_to_get_it() -> None:
    core = _without_boto3(
        "import warmpool_nodecache.fill, warmpool_nodecache.spec, warmpool_nodecache.push\n"
        "import warmpool_nodecache.__main__\n"
        "from warmpool_nodecache.spec import source_from_spec\n"
        "print(source_from_spec({'http': {'url': 'http://127.0.0.1:1/m'}}).describe())\n"
    )
    assert core.returncode == 0, core.stderr
    assert core.stdout.strip() == "http://127.0.0.1:1/m"
    s3 = _without_boto3("from warmpool_nodecache.spec import source_from_spec\n"
                        "source_from_spec({'s3': {'endpoint': 'http://127.0.0.1:1', 'bucket': 'b'}})\n")
    assert s3.returncode == 1
    assert "needs boto3, which is not installed" in s3.stderr and "warmpool[nodecache]" in s3.stderr
