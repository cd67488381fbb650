"""S3 credentials beyond a static key pair, against the real object store (SeaweedFS on loopback):
a session token, a profile of a shared credentials file (from a WarmModel's Secret and through
boto3's default chain), the node agent's lent default chain, the region a request is signed for,
and an https endpoint behind a CA of the test's own (a loopback TLS front that also shows what
went on the wire).  Web identity (IRSA) needs an STS, which is not on this machine: the chain is
shown to pick it from the environment, and no request is made.

Every source here is built the way the node agent builds one (``agent.open_source`` from a
WarmModel's spec.model block and its Secret's data), with loopback allowed by the address policy."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.certs import generate_pki
from warmpool_devcluster.seaweedfs import SeaweedHandle
from warmpool_nodecache import agent
from warmpool_nodecache.manifest import parse_manifest
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.push import push_model
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig, SourceAuthError, make_client
from warmpool_nodecache.source import SourceError
from warmpool_nodecache.spec import SourceSpecError

from tests.support.tls_recording_proxy import TlsRecordingProxy

pytestmark = pytest.mark.integration

PREFIX = "creds/r1"
LOOPBACK = AddressPolicy(allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),))
#: The AWS variables that would let the test process's own environment answer for a source.
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
           "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ROLE_ARN",
           "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_EC2_METADATA_DISABLED", "AWS_CA_BUNDLE")


@pytest.fixture(autouse=True)
def clean_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS setting of the machine leaks in; the metadata endpoints are never asked (no network)."""
    for name in AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


@pytest.fixture(scope="module")
def store(loopback_s3_store: SeaweedHandle) -> SeaweedHandle:
    return loopback_s3_store  # shared with the other modules that use the store directly (conftest.py)


@pytest.fixture(scope="module")
def manifest(store: SeaweedHandle, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The pushed revision's digest."""
    from warmpool_dev.testing_models import make_tiny_llama

    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "m", layers=2, seed=1)
    config = S3SourceConfig(store.endpoint, store.bucket, PREFIX,
                            credentials=S3Credentials(store.access_key_id, store.secret_access_key))
    return push_model(model, config, block_size=64 * 1024).digest


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA of the test's own and a serving certificate it issued for 127.0.0.1."""
    directory = tmp_path_factory.mktemp("pki")
    generate_pki(directory)
    return directory


@pytest.fixture()
def front(store: SeaweedHandle, pki: Path) -> Iterator[TlsRecordingProxy]:
    host, _, port = store.endpoint.removeprefix("http://").partition(":")
    proxy = TlsRecordingProxy((host, int(port)), pki / "apiserver.crt", pki / "apiserver.key")
    try:
        yield proxy
    finally:
        proxy.close()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def s3_block(endpoint: str, store: SeaweedHandle, **extra: Any) -> dict[str, Any]:
    return {"s3": {"endpoint": endpoint, "bucket": store.bucket, "prefix": PREFIX, **extra}}


def read_digest(source: Any) -> str:
    return parse_manifest(source.fetch_manifest()).digest


def test_a_session_token_is_signed_and_sent_with_the_key_pair(store: SeaweedHandle, manifest: str,
                                                              front: TlsRecordingProxy, pki: Path) -> None:
    """Temporary credentials from the WarmModel's Secret (AWS_SESSION_TOKEN beside the pair): the
    token goes on every request (X-Amz-Security-Token) and is among the signed headers.  SeaweedFS
    with static identities accepts the pair and does not check the token itself (as tested: a made-up
    token passes); AWS checks it -- the token's part here is reaching the wire, signed."""
    token = "FwoGZXIvYXdzEXAMPLE-session-token"
    secret = {"AWS_ACCESS_KEY_ID": b64(store.access_key_id), "AWS_SECRET_ACCESS_KEY": b64(store.secret_access_key),
              "AWS_SESSION_TOKEN": b64(token)}
    ca = {"ca.crt": b64((pki / "ca.crt").read_text())}
    source = agent.open_source(s3_block(front.endpoint, store, secretRef={"name": "s"}, caBundle={"name": "ca"}),
                               secret, policy=LOOPBACK, ca_bundle=agent_ca(ca))
    assert read_digest(source) == manifest
    heads = front.request_heads()
    assert heads and all(h.get("x-amz-security-token") == token for h in heads), heads
    assert all("x-amz-security-token" in h["authorization"].split("SignedHeaders=")[1].split(",")[0]
               for h in heads)


def agent_ca(data: dict[str, str]) -> str:
    from warmpool_nodecache.spec import ca_bundle_from_secret_data

    return ca_bundle_from_secret_data(data, "ca.crt", "Secret ns/ca")


def test_a_profile_of_a_shared_credentials_file_in_the_secret(store: SeaweedHandle, manifest: str) -> None:
    """spec.model.s3.profile picks the section; only the key lines are read (a credential_process
    line would run a command under botocore's own file reading: here it is never run)."""
    marker = Path("/tmp") / f"warmpool-credential-process-ran-{store.access_key_id}"
    credentials_file = (
        "[default]\naws_access_key_id = WRONGWRONGWRONGWRONG\naws_secret_access_key = wrong\n\n"
        f"[readers]\naws_access_key_id = {store.access_key_id}\naws_secret_access_key = {store.secret_access_key}\n"
        f"credential_process = /bin/touch {marker}\n"
    )
    secret = {"credentials": b64(credentials_file)}
    source = agent.open_source(s3_block(store.endpoint, store, secretRef={"name": "s"}, profile="readers"),
                               secret, "Secret ns/s", policy=LOOPBACK)
    assert read_digest(source) == manifest
    assert not marker.exists()
    # The [default] section holds a refused pair: the store's refusal names its key id, never the secret.
    wrong = agent.open_source(s3_block(store.endpoint, store, secretRef={"name": "s"}), secret, "Secret ns/s",
                              policy=LOOPBACK)
    with pytest.raises(SourceAuthError, match="WRONGWRONGWRONGWRONG"):
        wrong.fetch_manifest()
    with pytest.raises(SourceError, match=r"Secret ns/s key 'credentials': no \[writers\] section"):
        agent.open_source(s3_block(store.endpoint, store, secretRef={"name": "s"}, profile="writers"), secret,
                          "Secret ns/s", policy=LOOPBACK)


def test_the_agents_lent_default_chain_reads_its_profile(store: SeaweedHandle, manifest: str,
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No secretRef: with --s3-default-credentials the agent signs with its own chain (here
    AWS_PROFILE and the shared files, as a platform mounts them); without it, unsigned, which the
    store refuses."""
    shared = tmp_path / "credentials"
    shared.write_text(f"[models]\naws_access_key_id = {store.access_key_id}\n"
                      f"aws_secret_access_key = {store.secret_access_key}\n")
    config = tmp_path / "config"
    config.write_text("[profile models]\nregion = eu-central-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "models")
    block = s3_block(store.endpoint, store)
    lent = agent.open_source(block, None, policy=LOOPBACK, default_chain=True)
    assert read_digest(lent) == manifest
    assert isinstance(lent, S3Source) and lent._client.meta.region_name == "eu-central-1"  # the profile's region
    unsigned = agent.open_source(block, None, policy=LOOPBACK)
    with pytest.raises(SourceAuthError, match=r"refused access key id '\(unsigned\)'"):
        unsigned.fetch_manifest()
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(SourceError, match="profile"):
        agent.open_source(block, None, policy=LOOPBACK, default_chain=True)


def test_the_default_chain_takes_environment_credentials_and_says_when_it_finds_none(
        store: SeaweedHandle, manifest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    block = s3_block(store.endpoint, store)
    with pytest.raises(SourceError, match="default credential chain found no credentials"):
        agent.open_source(block, None, policy=LOOPBACK, default_chain=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store.secret_access_key)
    assert read_digest(agent.open_source(block, None, policy=LOOPBACK, default_chain=True)) == manifest
    # A WarmModel with a secretRef never gets the agent's own credentials, lent or not.
    with pytest.raises(SourceSpecError, match="secretRef names Secret"):
        agent.open_source(s3_block(store.endpoint, store, secretRef={"name": "s"}), None, policy=LOOPBACK,
                          default_chain=True)


def test_web_identity_is_what_the_chain_picks_from_irsas_environment(store: SeaweedHandle,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """What IRSA puts in a pod's environment makes boto3's chain choose AssumeRoleWithWebIdentity
    (deferred: STS is asked at the first signed request, and there is no STS here, so none is made)."""
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.e30.c2ln")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/warmpool-node-agent")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    client = make_client(S3SourceConfig(store.endpoint, store.bucket, PREFIX, default_chain=True, region="eu-west-1"))
    credentials = client._request_signer._credentials
    assert credentials.method == "assume-role-with-web-identity"


def test_the_region_reaches_the_signed_request(store: SeaweedHandle, manifest: str,
                                               front: TlsRecordingProxy, pki: Path) -> None:
    secret = {"AWS_ACCESS_KEY_ID": b64(store.access_key_id), "AWS_SECRET_ACCESS_KEY": b64(store.secret_access_key)}
    ca = agent_ca({"ca.crt": b64((pki / "ca.crt").read_text())})
    for region, scope in (("eu-west-1", "/eu-west-1/s3/aws4_request"), (None, "/us-east-1/s3/aws4_request")):
        extra = {"region": region} if region else {}
        source = agent.open_source(s3_block(front.endpoint, store, secretRef={"name": "s"},
                                            caBundle={"name": "ca"}, **extra),
                                   secret, policy=LOOPBACK, ca_bundle=ca)
        before = len(front.request_heads())
        assert read_digest(source) == manifest
        heads = front.request_heads()[before:]
        assert heads and all(scope in h["authorization"] for h in heads), (region, heads)


def test_an_https_endpoint_is_trusted_only_through_its_ca_bundle(store: SeaweedHandle, manifest: str,
                                                                 front: TlsRecordingProxy, pki: Path,
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    secret = {"AWS_ACCESS_KEY_ID": b64(store.access_key_id), "AWS_SECRET_ACCESS_KEY": b64(store.secret_access_key)}
    block = s3_block(front.endpoint, store, secretRef={"name": "s"}, caBundle={"name": "ca"})
    right = agent_ca({"ca.crt": b64((pki / "ca.crt").read_text())})
    assert read_digest(agent.open_source(block, secret, policy=LOOPBACK, ca_bundle=right)) == manifest
    # The system's trust store does not know the test's CA, nor does another CA.
    other = tmp_path / "other"
    generate_pki(other)
    plain = {"s3": {k: v for k, v in block["s3"].items() if k != "caBundle"}}
    for source in (agent.open_source(plain, secret, policy=LOOPBACK),
                   agent.open_source(block, secret, policy=LOOPBACK, ca_bundle=(other / "ca.crt").read_text())):
        sent = len(front.request_heads())
        with pytest.raises(SourceError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            source.fetch_manifest()
        assert len(front.request_heads()) == sent  # not a byte of the request (nor its signature) went out
    # A platform-wide CA as the agent's own trust store (what examples/object-store-s3.yaml says).
    monkeypatch.setenv("SSL_CERT_FILE", str(pki / "ca.crt"))
    assert read_digest(agent.open_source(plain, secret, policy=LOOPBACK)) == manifest
    monkeypatch.delenv("SSL_CERT_FILE")
    # The Secret's key must hold a certificate; the spec must name the bundle's Secret to get one.
    with pytest.raises(SourceSpecError, match=r"no PEM certificate under 'ca\.crt'"):
        agent_ca({"ca.crt": b64("not a certificate")})
    with pytest.raises(SourceSpecError, match="caBundle names Secret 'ca'"):
        agent.open_source(block, secret, policy=LOOPBACK)
    # `warmpool model push` sends through botocore itself: the bundle is its verify= (a private file).
    client = make_client(S3SourceConfig(front.endpoint, store.bucket, PREFIX, ca_bundle=right,
                                        credentials=S3Credentials(store.access_key_id, store.secret_access_key)))
    listed = client.list_objects_v2(Bucket=store.bucket, Prefix=PREFIX)
    assert listed["KeyCount"] > 0
