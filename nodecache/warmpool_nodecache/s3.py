"""An S3-compatible object store as a fill `Source` (``spec.model.s3``), through boto3.

Layout: the revision's files are objects ``<prefix>/<file path>`` in ``bucket``, and its
manifest is ``<prefix>/warmpool-manifest.json`` (written last by ``warmpool model push``).

boto3 is imported only when a client is made, so the cache core (and the HTTP source) stay
standard-library only.  Every request is bounded: connect/read timeouts and botocore's
"standard" retry mode with a fixed attempt count (transient 5xx, throttling, connection
errors); a truncated body is read again the same bounded number of times.  Errors say
what is wrong in the reader's terms: refused credentials name the access key id (never the
secret) and the endpoint; a missing bucket names the bucket; a key that would climb out
of the prefix (``..``, absolute, backslash) is refused before any request is made.

An ``S3Source`` sends every request through ``s3_transport.BoundedTransport`` (boto3 still signs
them): the endpoint's addresses are checked by the config's ``AddressPolicy`` (a WarmModel's
source always has one), the connection goes to a checked address, no redirect is followed,
answers are capped (the manifest at ``max_manifest_bytes``, a range at the bytes asked for) and
each read -- retries included -- ends by ``ReadLimits.deadline_s``.

Block reads take a faster path (``S3Source.fetch_range``): boto3 signs a GET of each object once
(a presigned URL, valid ``PRESIGN_EXPIRES_S``, signed again after ``PRESIGN_RENEW_S``), and each
ranged GET of a block goes straight through ``http_exchange`` with that URL and a ``Range`` header
-- the same address check, cap and deadline, without botocore's per-request cost (signing, its
event hooks, parsing: about 2-3 ms a request, on the 239 requests of a 1 GB model).  The bytes are
verified by the fill as before.  Any answer but a whole 206 -- an error, a refusal, a short body,
no connection -- is asked again through boto3 (its retries, its errors in the reader's terms), within
the same deadline: the presigned URL carries a signature and is never put in an error or a log.

Credentials, in the order a config names them:

* ``credentials``: a static key pair, with a session token when they are temporary (STS's
  AssumeRole, ``aws sts get-session-token``, a vault's lease).  From a WarmModel's Secret, from the
  ``AWS_*`` environment of a command, or from one profile of a shared credentials file -- read
  here, key by key (:func:`credentials_from_ini`), never handed to botocore as a file: botocore
  would also honour a ``credential_process`` line there and run it.
* ``default_chain``: boto3's own default chain in this process -- environment, web identity
  (``AWS_ROLE_ARN`` + ``AWS_WEB_IDENTITY_TOKEN_FILE``: IRSA and the like, through STS), the
  profile ``AWS_PROFILE`` names in the shared files, the container and instance metadata
  endpoints.  Whose credentials these are is the process's business: the node agent uses them
  only when its operator lent them (``--s3-default-credentials``), as they then read for every
  WarmModel that names no Secret.  The address policy guards the requests to the *store* only:
  botocore fetches credentials (STS, 169.254.169.254, the ECS/EKS container endpoint) through its
  own HTTP client, which the policy never sees -- refusing metadata addresses as object URLs is
  unchanged, and reaching them for credentials is the platform's choice, made by the lending.
* neither: unsigned requests (a public bucket).

``region`` is what SigV4 signs for (a store checks it); unset, the default chain's region
(``AWS_REGION``, the profile's) where the chain is used, else ``us-east-1``, S3's own default.
``ca_bundle`` (PEM text) replaces the system's trust store for an https endpoint: the bounded
transport verifies with it, and a client botocore sends through itself (``warmpool model push``)
gets it as ``verify=``.
"""

from __future__ import annotations

import configparser
import functools
import hashlib
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from warmpool.contract.files import MANIFEST_FILENAME
from warmpool_nodecache.http_exchange import ReadLimits, exchange, parse_url
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.s3_transport import BoundedTransport
from warmpool_nodecache.source_errors import SourceError, SourceLimitError, SourceMissingError

#: Error codes S3 (and SeaweedFS) answer for credentials it does not accept.
_AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                         "InvalidClientTokenId", "AuthorizationHeaderMalformed"})
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class SourceAuthError(SourceError):
    """The store refused the credentials (the message names the key id and endpoint)."""


class S3KeyError(SourceError):
    """A key or prefix that would escape the revision's prefix; refused before any request."""


#: The region a request is signed for when nothing names one (S3's own default).
DEFAULT_REGION = "us-east-1"
#: How long a presigned URL of the block reads' fast path is valid, and its age when it is signed
#: again (well before it expires: a read that starts with it may take the read deadline).
PRESIGN_EXPIRES_S = 900
PRESIGN_RENEW_S = 300


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)  # never printed, logged or put in an error
    session_token: str | None = field(default=None, repr=False)  # temporary credentials (STS) carry one


def check_key_part(value: str, what: str) -> str:
    """A relative, normalised POSIX key fragment, or S3KeyError (before any request)."""
    if "\\" in value or "\x00" in value:
        raise S3KeyError(f"{what} {value!r} holds a backslash or NUL; refused")
    if value.startswith("/") or PurePosixPath(value).is_absolute():
        raise S3KeyError(f"{what} {value!r} is absolute; it must be relative to the bucket's prefix")
    parts = value.split("/")
    if ".." in parts:
        raise S3KeyError(f"{what} {value!r} has a '..' component and would escape the prefix; refused")
    if any(part in ("", ".") for part in parts):
        raise S3KeyError(f"{what} {value!r} has an empty or '.' component; write it normalised")
    return value


def normalise_prefix(prefix: str) -> str:
    """``a/b/`` -> ``a/b``; ``""`` stays the bucket's root.  Refuses what `check_key_part` refuses."""
    stripped = prefix.rstrip("/")
    return check_key_part(stripped, "prefix") if stripped else ""


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, normalised prefix)."""
    if not url.startswith("s3://"):
        raise SourceError(f"{url!r} is not an s3://bucket/prefix URL")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise SourceError(f"{url!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, normalise_prefix(prefix)


def credentials_from_env(environ: dict[str, str] | None = None) -> S3Credentials | None:
    """The standard ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` pair (and ``AWS_SESSION_TOKEN``),
    or None if unset."""
    env = os.environ if environ is None else environ
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key and not secret:
        return None
    if not key or not secret:
        raise SourceError("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither")
    return S3Credentials(key, secret, env.get("AWS_SESSION_TOKEN") or None)


def credentials_from_ini(text: str, profile: str, where: str) -> S3Credentials:
    """One profile of an AWS shared-credentials file's text (INI: ``[profile]`` with
    aws_access_key_id, aws_secret_access_key and optionally aws_session_token).  Only those keys
    are read: a ``credential_process`` or ``role_arn`` line is ignored, never run or followed."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, where)
    except configparser.Error as exc:
        raise SourceError(f"{where}: not an AWS credentials file ({exc.__class__.__name__})") from None
    if not parser.has_section(profile):
        raise SourceError(f"{where}: no [{profile}] section")
    key = parser.get(profile, "aws_access_key_id", fallback="").strip()
    secret = parser.get(profile, "aws_secret_access_key", fallback="").strip()
    token = parser.get(profile, "aws_session_token", fallback="").strip()
    if not key or not secret:
        raise SourceError(f"{where}: [{profile}] needs aws_access_key_id and aws_secret_access_key")
    return S3Credentials(key, secret, token or None)


def credentials_from_file(path: Path, profile: str = "default") -> S3Credentials:
    """Read one profile of an AWS shared-credentials file (see :func:`credentials_from_ini`)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SourceError(f"credentials file {path}: {exc.strerror or exc}") from None
    return credentials_from_ini(text, profile, f"credentials file {path}")


def tls_context(ca_bundle: str | None) -> ssl.SSLContext | None:
    """A client TLS context that trusts exactly the PEM certificates ``ca_bundle`` holds (None: the
    system's trust store); SourceError when the text holds no certificate."""
    if ca_bundle is None:
        return None
    try:
        return ssl.create_default_context(cadata=ca_bundle)
    except (ssl.SSLError, ValueError) as exc:
        raise SourceError(f"the CA bundle holds no usable PEM certificate ({exc})") from None


@functools.lru_cache(maxsize=32)
def _ca_file(ca_bundle: str) -> str:
    """The bundle as a file only this process's user reads, for botocore's ``verify=`` (a path)."""
    digest = hashlib.sha256(ca_bundle.encode()).hexdigest()[:16]
    fd, path = tempfile.mkstemp(prefix=f"warmpool-ca-{digest}-", suffix=".pem")
    with os.fdopen(fd, "w") as fh:
        fh.write(ca_bundle)
    return path


@dataclass(frozen=True)
class S3SourceConfig:
    endpoint: str  # e.g. http://127.0.0.1:8333 (path-style addressing: works with any S3-compatible store)
    bucket: str
    prefix: str = ""
    credentials: S3Credentials | None = None  # None: default_chain, or unsigned requests (a public bucket)
    region: str | None = None  # None: the default chain's region where it is used, else DEFAULT_REGION
    #: Without credentials: boto3's default chain of this process (see the module's docstring).
    default_chain: bool = False
    ca_bundle: str | None = field(default=None, repr=False)  # PEM text; None: the system's trust store
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    attempts: int = 4
    #: None: the caller vouches for the endpoint (an operator's own command line); a WarmModel's
    #: source always gets the node agent's policy.
    policy: AddressPolicy | None = None
    limits: ReadLimits = field(default_factory=ReadLimits)


def require_boto3() -> None:
    """A SourceError saying how to install boto3 when it is missing (it is an extra: 'nodecache')."""
    try:
        import boto3  # noqa: F401
    except ModuleNotFoundError as exc:
        raise SourceError(f"the S3 source needs boto3, which is not installed ({exc}): "
                          "pip install 'warmpool[nodecache]'") from None


def make_client(config: S3SourceConfig) -> Any:
    """A boto3 S3 client for `config` (boto3 imported here, and only here)."""
    require_boto3()
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    if config.attempts < 1 or config.connect_timeout_s <= 0 or config.read_timeout_s <= 0:
        raise SourceError(f"{config.endpoint}: attempts must be >= 1 and timeouts > 0")
    parse_url(config.endpoint)  # SourceError naming what is wrong (botocore would raise ValueError)
    tls_context(config.ca_bundle)  # a bundle that holds no certificate is said now, not at the first read
    creds = config.credentials
    if creds is not None:
        # A session of its own: no profile, config file or environment credentials leak in.
        session = boto3.session.Session(
            aws_access_key_id=creds.access_key_id,
            aws_secret_access_key=creds.secret_access_key,
            aws_session_token=creds.session_token,
            region_name=config.region or DEFAULT_REGION,
        )
    elif config.default_chain:
        from botocore.exceptions import BotoCoreError

        try:
            session = boto3.session.Session(region_name=config.region)
            found = session.get_credentials()
        except BotoCoreError as exc:  # e.g. AWS_PROFILE names a profile the shared files lack
            raise SourceError(f"{config.endpoint}: boto3's default credential chain: {exc}") from None
        if found is None:
            raise SourceError(f"{config.endpoint}: boto3's default credential chain found no credentials "
                              "(environment, web identity, AWS_PROFILE's shared files, container or instance "
                              "metadata)")
    else:
        session = boto3.session.Session(aws_access_key_id=None, aws_secret_access_key=None,
                                        region_name=config.region or DEFAULT_REGION)
    signed = creds is not None or config.default_chain
    region = config.region or session.region_name or DEFAULT_REGION
    botocore_config = Config(
        region_name=region,
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": config.attempts},
        s3={"addressing_style": "path"},
        signature_version="s3v4" if signed else UNSIGNED,
        # Checksums only when an operation requires them: S3-compatible stores differ in
        # their support of the newer default CRC trailers.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    verify = _ca_file(config.ca_bundle) if config.ca_bundle is not None else None
    try:
        return session.client("s3", endpoint_url=config.endpoint, config=botocore_config, verify=verify)
    except ValueError as exc:  # botocore's own check of the endpoint (e.g. an underscore in the host)
        raise SourceError(f"endpoint {config.endpoint!r} is not a valid S3 endpoint URL ({exc})") from None


def explain(exc: BaseException, config: S3SourceConfig, key: str | None) -> SourceError:
    """A botocore exception as a SourceError in the reader's terms (never the secret)."""
    from botocore.exceptions import BotoCoreError, ClientError

    where = f"s3://{config.bucket}/{key}" if key is not None else f"s3://{config.bucket}"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return SourceMissingError(f"bucket {config.bucket!r} does not exist at {config.endpoint} ({where})")
        if code in _AUTH_CODES or status == 403:
            key_id = (config.credentials.access_key_id if config.credentials
                      else "(the default credential chain's)" if config.default_chain else "(unsigned)")
            return SourceAuthError(
                f"{config.endpoint} refused access key id {key_id!r} for {where} ({code or status}): "
                "wrong credentials, or they lack read/write on the bucket"
            )
        if code in _MISSING_KEY_CODES or status == 404:
            return SourceMissingError(f"{where}: not found at {config.endpoint}")
        return SourceError(f"{where} at {config.endpoint}: {code or status} {error.get('Message', '')}".rstrip())
    if isinstance(exc, BotoCoreError):
        return SourceError(f"{where}: {config.endpoint} did not answer after {config.attempts} attempts: {exc}")
    return SourceError(f"{where} at {config.endpoint}: {exc}")


class S3Source:
    """The `Source` Protocol over an S3 bucket and prefix (see the module's docstring)."""

    def __init__(self, config: S3SourceConfig, client: Any = None) -> None:
        if not config.bucket or "/" in config.bucket:
            raise SourceError(f"bucket {config.bucket!r} is not a bucket name")
        self.config = replace(config, prefix=normalise_prefix(config.prefix))
        try:
            self.config.limits.check()
        except ValueError as error:
            raise SourceError(f"{config.endpoint}: {error}") from None
        if client is not None and config.policy is not None:
            raise SourceError("an S3 source with an address policy makes its own client (it sends through it)")
        self._transport = BoundedTransport(config.policy, self.config.limits, config.read_timeout_s,
                                           tls_context(config.ca_bundle))
        if client is None:
            client = make_client(self.config)
            client.meta.events.register("before-send.s3", self._transport)
        self._client = client
        self._presigned: dict[str, tuple[str, float]] = {}  # key -> (URL, when signed)
        self._presign_lock = threading.Lock()

    def describe(self) -> str:
        prefix = f"/{self.config.prefix}" if self.config.prefix else ""
        return f"s3://{self.config.bucket}{prefix}"

    def key(self, path: str) -> str:
        check_key_part(path, "object path")
        return f"{self.config.prefix}/{path}" if self.config.prefix else path

    def _missing_bucket_or(self, error: SourceError) -> SourceError:
        """A HEAD's bare 404 does not say whether the key or the bucket is missing: ask."""
        if not isinstance(error, SourceMissingError):
            return error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.config.bucket)
        except (ClientError, BotoCoreError) as exc:
            found = explain(exc, self.config, None)
            if isinstance(found, SourceMissingError):
                return SourceMissingError(f"bucket {self.config.bucket!r} does not exist at {self.config.endpoint}")
            return found
        return error

    def _get(self, key: str, byte_range: str | None, cap: int, deadline: float | None = None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        last: Exception | None = None
        extra = {"Range": byte_range} if byte_range else {}
        with self._transport.bounds(cap, deadline):
            for _ in range(self.config.attempts):
                try:  # botocore retries the request itself (bounded by the same attempt count)
                    response = self._client.get_object(Bucket=self.config.bucket, Key=key, **extra)
                except (ClientError, BotoCoreError) as exc:
                    raise self._missing_bucket_or(explain(exc, self.config, key)) from None
                try:
                    body: bytes = response["Body"].read()
                    return body
                except (BotoCoreError, OSError) as exc:  # a body cut off mid-read: ask again, bounded
                    last = exc
        assert last is not None
        raise explain(last, self.config, key) from None

    def fetch_manifest(self) -> bytes:
        return self._get(self.key(MANIFEST_FILENAME), None, self.config.limits.max_manifest_bytes)

    def size(self, path: str) -> int:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key(path)
        try:
            with self._transport.bounds(0):
                head = self._client.head_object(Bucket=self.config.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise self._missing_bucket_or(explain(exc, self.config, key)) from None
        length = head.get("ContentLength")
        if not isinstance(length, int):
            raise SourceError(f"s3://{self.config.bucket}/{key}: HEAD gave no Content-Length")
        return length

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        key = self.key(path)
        if length > self.config.limits.max_block_bytes:
            raise SourceLimitError(f"s3://{self.config.bucket}/{key}: a range of {length} bytes is past the "
                                   f"{self.config.limits.max_block_bytes}-byte block limit")
        byte_range = f"bytes={offset}-{offset + length - 1}"
        deadline = time.monotonic() + self.config.limits.deadline_s
        body = self._get_presigned(key, byte_range, length, deadline)
        if body is None:
            body = self._get(key, byte_range, length, deadline)
        if len(body) != length:
            raise SourceError(
                f"s3://{self.config.bucket}/{key}: bytes {offset}+{length} came back short "
                "(is the object shorter than the manifest says?)"
            )
        return body

    def _presigned_url(self, key: str) -> str:
        now = time.monotonic()
        with self._presign_lock:
            known = self._presigned.get(key)
            if known is not None and now - known[1] < PRESIGN_RENEW_S:
                return known[0]
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.config.bucket, "Key": key}, ExpiresIn=PRESIGN_EXPIRES_S)
        with self._presign_lock:
            self._presigned[key] = (url, now)
        return url

    def _get_presigned(self, key: str, byte_range: str, length: int, deadline: float) -> bytes | None:
        """The range through the object's presigned URL, or None when anything but a whole 206 came
        back (the caller asks again through boto3, which says what went wrong without the URL)."""
        from botocore.exceptions import BotoCoreError

        try:
            url = self._presigned_url(key)
            reply = exchange(url, "GET", {"Range": byte_range}, policy=self.config.policy, cap=length,
                             deadline=deadline, socket_timeout_s=self.config.read_timeout_s,
                             context=self._transport.tls, wanted=frozenset({206}))
        except (SourceError, BotoCoreError, ValueError):
            return None
        if reply.status != 206 or len(reply.body) != length:
            return None
        return reply.body
