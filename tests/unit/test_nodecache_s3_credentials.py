"""How an s3 source's credentials, region and CA bundle are read from a WarmModel's spec and Secret
(no store: tests/integration/test_nodecache_s3_credentials.py reads a real one with each)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from warmpool_devcluster.certs import generate_pki
from warmpool_nodecache import agent_cli
from warmpool_nodecache.s3 import DEFAULT_REGION, S3Credentials, S3Source, S3SourceConfig, make_client, tls_context
from warmpool_nodecache.source import SourceError
from warmpool_nodecache.spec import (
    SourceSpecError,
    ca_bundle_from_secret_data,
    ca_bundle_ref,
    credentials_from_secret_data,
    source_from_spec,
)

pytestmark = pytest.mark.unit

PAIR = {"AWS_ACCESS_KEY_ID": "QUtJQQ==", "AWS_SECRET_ACCESS_KEY": "c2VjcmV0"}  # AKIA / secret
ENDPOINT = "http://127.0.0.1:8333"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_session_token_rides_with_the_pair_and_is_never_printed() -> None:
    creds = credentials_from_secret_data({**PAIR, "AWS_SESSION_TOKEN": b64("tok-123")})
    assert (creds.access_key_id, creds.secret_access_key, creds.session_token) == ("AKIA", "secret", "tok-123")
    assert "tok-123" not in repr(creds) and "secret" not in repr(creds)
    assert credentials_from_secret_data(PAIR).session_token is None


def test_a_shared_credentials_file_in_the_secret() -> None:
    text = ("[default]\naws_access_key_id = D\naws_secret_access_key = d\n"
            "[readers]\naws_access_key_id = R\naws_secret_access_key = r\naws_session_token = t\n"
            "credential_process = /bin/false\n")
    assert credentials_from_secret_data({"credentials": b64(text)}) == S3Credentials("D", "d")
    assert credentials_from_secret_data({"credentials": b64(text)}, profile="readers") == S3Credentials("R", "r", "t")
    # Both in one Secret: the pair, unless a profile is named.
    assert credentials_from_secret_data({**PAIR, "credentials": b64(text)}).access_key_id == "AKIA"
    with pytest.raises(SourceSpecError, match=r"spec\.model\.s3\.profile names a section"):
        credentials_from_secret_data(PAIR, "Secret ns/s", profile="readers")
    with pytest.raises(SourceError, match=r"Secret ns/s key 'credentials': \[readers\] needs aws_access_key_id"):
        credentials_from_secret_data({"credentials": b64("[readers]\nregion = x\n")}, "Secret ns/s", profile="readers")
    with pytest.raises(SourceSpecError, match="optionally AWS_SESSION_TOKEN"):
        credentials_from_secret_data({"AWS_ACCESS_KEY_ID": PAIR["AWS_ACCESS_KEY_ID"]})


def test_the_ca_bundle_reference_and_its_text(tmp_path: Path) -> None:
    assert ca_bundle_ref({"s3": {"caBundle": {"name": "ca"}}}) == ("ca", "ca.crt")
    assert ca_bundle_ref({"s3": {"caBundle": {"name": "ca", "key": "bundle.pem"}}}) == ("ca", "bundle.pem")
    assert ca_bundle_ref({"s3": {}}) is None and ca_bundle_ref({"http": {"url": "http://x"}}) is None
    generate_pki(tmp_path)
    pem = (tmp_path / "ca.crt").read_text()
    assert ca_bundle_from_secret_data({"ca.crt": b64(pem)}, "ca.crt") == pem
    assert tls_context(pem) is not None and tls_context(None) is None
    with pytest.raises(SourceSpecError, match=r"no PEM certificate under 'bundle\.pem'"):
        ca_bundle_from_secret_data({"ca.crt": b64(pem)}, "bundle.pem")
    with pytest.raises(SourceError, match="holds no usable PEM certificate"):
        tls_context("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")


def test_the_region_is_what_the_spec_names_else_s3s_default() -> None:
    creds = S3Credentials("AKIA", "secret")
    block = {"endpoint": ENDPOINT, "bucket": "models", "secretRef": "s", "region": "eu-west-1"}
    named = source_from_spec({"s3": block}, credentials=creds)
    assert isinstance(named, S3Source) and named.config.region == "eu-west-1"
    assert named._client.meta.region_name == "eu-west-1"
    unnamed = source_from_spec({"s3": {"endpoint": ENDPOINT, "bucket": "models", "secretRef": "s"}}, credentials=creds)
    assert isinstance(unnamed, S3Source) and unnamed._client.meta.region_name == DEFAULT_REGION == "us-east-1"
    unsigned = make_client(S3SourceConfig(ENDPOINT, "models", region="ap-south-1"))
    assert unsigned.meta.region_name == "ap-south-1"


def test_a_secret_ref_is_never_answered_by_the_agents_own_chain() -> None:
    source = source_from_spec({"s3": {"endpoint": ENDPOINT, "bucket": "models", "secretRef": "s"}},
                              credentials=S3Credentials("AKIA", "secret"), default_chain=True)
    assert isinstance(source, S3Source) and not source.config.default_chain
    with pytest.raises(SourceSpecError, match="caBundle names Secret 'ca'"):
        source_from_spec({"s3": {"endpoint": "https://s3.example.com", "bucket": "models", "caBundle": {"name": "ca"}}})


def test_the_agent_lends_its_own_credentials_only_when_told() -> None:
    parser = agent_cli.build_parser()
    assert parser.parse_args([]).s3_default_credentials is False
    assert parser.parse_args(["--s3-default-credentials"]).s3_default_credentials is True
    assert "--s3-default-credentials" in parser.format_help()
