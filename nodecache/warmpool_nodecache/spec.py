"""A WarmModel's ``spec.model`` (as a plain dict) -> the fill `Source` it names.

This is the node agent's entry point to the sources::

    source = source_from_spec(wm["spec"]["model"]["source"], credentials=creds)
    fill_revision(layout, source, ...)

Accepted shapes (camelCase, as in the WarmModel; exactly one of the two keys)::

    {"http": {"url": "http://host/models/x"}}
    {"s3": {"endpoint": "http://127.0.0.1:8333", "bucket": "models", "prefix": "smollm2/r1",
            "secretRef": "models-s3"}}          # or secretRef: {"name": "models-s3"}; optional

The agent reads the Secret that `secret_ref_name` returns (keys
``contract.S3_SECRET_ACCESS_KEY_ID_KEY`` / ``S3_SECRET_SECRET_ACCESS_KEY_KEY`` and optionally
``S3_SECRET_SESSION_TOKEN_KEY``, or a shared credentials file under
``S3_SECRET_CREDENTIALS_FILE_KEY`` with ``profile`` naming its section), turns its ``.data`` into
credentials with `credentials_from_secret_data`, and passes them in; likewise the PEM text of
``caBundle`` (`ca_bundle_ref`, `ca_bundle_from_secret_data`).  This module does no Kubernetes I/O.
An s3 source without secretRef uses the default credential chain when the caller lends it
(``default_chain``: the node agent's --s3-default-credentials), else reads unsigned (a public
bucket).  ``region`` is signed for as given.  Anything else (pvc, hostPath, both keys, a missing
field) is a SourceSpecError naming the field.  Building a source makes no request.

A source built from a spec is always guarded: its reads go only to addresses ``policy`` accepts
(by default an ``AddressPolicy`` that refuses loopback, link-local and host-internal ranges; the
node agent passes its own, with the cluster's networks) and stay within ``limits``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from warmpool.contract.files import (
    S3_CA_BUNDLE_DEFAULT_KEY,
    S3_SECRET_ACCESS_KEY_ID_KEY,
    S3_SECRET_CREDENTIALS_FILE_KEY,
    S3_SECRET_SECRET_ACCESS_KEY_KEY,
    S3_SECRET_SESSION_TOKEN_KEY,
)
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig, credentials_from_ini
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, ReadLimits, Source, SourceError

#: The guard of a source built from a spec when the caller names none (see the module docstring).
DEFAULT_POLICY = AddressPolicy()

#: The spec.model kinds a node agent fills from (pvc/hostPath are mounted, not filled).
FILLABLE_KINDS = ("http", "s3")


class SourceSpecError(SourceError):
    """spec.model cannot name a fill source; the message names the field."""


def source_kind(source: Mapping[str, Any]) -> str | None:
    """``"http"`` or ``"s3"`` when the source is one the agent fills from, else None."""
    kinds = [k for k in FILLABLE_KINDS if source.get(k) is not None]
    if len(kinds) > 1:
        raise SourceSpecError(f"spec.model sets both {kinds[0]} and {kinds[1]}; set one")
    return kinds[0] if kinds else None


def _field(body: Mapping[str, Any], kind: str, name: str, *, required: bool = True) -> str:
    value = body.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise SourceSpecError(f"spec.model.{kind}.{name} must be a non-empty string, got {value!r}")
    return value


def secret_ref_name(source: Mapping[str, Any]) -> str | None:
    """The Secret an s3 source's secretRef names (a string or ``{"name": ...}``), or None."""
    if source_kind(source) != "s3":
        return None
    ref = source["s3"].get("secretRef")
    if ref is None:
        return None
    name = ref.get("name") if isinstance(ref, Mapping) else ref
    if not isinstance(name, str) or not name:
        raise SourceSpecError(f"spec.model.s3.secretRef must name a Secret, got {ref!r}")
    return name


def _decoded(data: Mapping[str, str | bytes], key: str, secret: str) -> str | None:
    raw = data.get(key)
    if not raw:
        return None
    try:
        return base64.b64decode(raw, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise SourceSpecError(f"{secret}: {key!r} is not base64 of UTF-8 text") from None


def credentials_from_secret_data(data: Mapping[str, str | bytes], secret: str = "the Secret",
                                 profile: str | None = None) -> S3Credentials:
    """Credentials from a Secret's ``.data`` (base64 values, as the API returns them): the key pair
    (with a session token when there is one), or with ``profile`` -- or when the Secret holds only a
    credentials file -- that file's section (``[default]`` unless named)."""
    file_text = _decoded(data, S3_SECRET_CREDENTIALS_FILE_KEY, secret)
    if profile is not None or (file_text is not None and S3_SECRET_ACCESS_KEY_ID_KEY not in data):
        if file_text is None:
            raise SourceSpecError(f"{secret} has no {S3_SECRET_CREDENTIALS_FILE_KEY!r} key: spec.model.s3.profile "
                                  "names a section of a shared credentials file kept under it")
        return credentials_from_ini(file_text, profile or "default", f"{secret} key {S3_SECRET_CREDENTIALS_FILE_KEY!r}")
    values: dict[str, str] = {}
    for key in (S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY):
        value = _decoded(data, key, secret)
        if not value:
            raise SourceSpecError(f"{secret} has no {key!r} key (it needs {S3_SECRET_ACCESS_KEY_ID_KEY} and "
                                  f"{S3_SECRET_SECRET_ACCESS_KEY_KEY}, optionally {S3_SECRET_SESSION_TOKEN_KEY}; "
                                  f"or a shared credentials file as {S3_SECRET_CREDENTIALS_FILE_KEY!r})")
        values[key] = value.strip()
    token = (_decoded(data, S3_SECRET_SESSION_TOKEN_KEY, secret) or "").strip() or None
    return S3Credentials(values[S3_SECRET_ACCESS_KEY_ID_KEY], values[S3_SECRET_SECRET_ACCESS_KEY_KEY], token)


def ca_bundle_ref(source: Mapping[str, Any]) -> tuple[str, str] | None:
    """(Secret, key) of an s3 source's caBundle, or None."""
    if source_kind(source) != "s3":
        return None
    ref = source["s3"].get("caBundle")
    if ref is None:
        return None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    key = ref.get("key", S3_CA_BUNDLE_DEFAULT_KEY) if isinstance(ref, Mapping) else None
    if not isinstance(name, str) or not name or not isinstance(key, str) or not key:
        raise SourceSpecError(f"spec.model.s3.caBundle must name a Secret and a key, got {ref!r}")
    return name, key


def ca_bundle_from_secret_data(data: Mapping[str, str | bytes], key: str, secret: str = "the Secret") -> str:
    """The PEM text under ``key`` of a Secret's ``.data``."""
    text = _decoded(data, key, secret)
    if not text or "-----BEGIN CERTIFICATE-----" not in text:
        raise SourceSpecError(f"{secret} has no PEM certificate under {key!r} (spec.model.s3.caBundle)")
    return text


def source_from_spec(
    source: Mapping[str, Any], *, credentials: S3Credentials | None = None, client: Any = None,
    policy: AddressPolicy = DEFAULT_POLICY, limits: ReadLimits | None = None, ca_bundle: str | None = None,
    default_chain: bool = False,
) -> Source:
    """The Source for `source` (a WarmModel's spec.model dict); see the module's docstring.

    `ca_bundle`: the PEM text caBundle names (read it and pass it in).  `default_chain`: an s3
    source without secretRef signs with boto3's default chain of this process (the caller lends
    its own credentials) rather than not at all.

    `client`: a boto3 S3 client to send through instead of one of its own -- unguarded, so only
    for a caller that vouches for the endpoint (the guard needs the client the source makes).
    """
    limits = limits or ReadLimits()
    kind = source_kind(source)
    if kind is None:
        raise SourceSpecError(
            f"spec.model has no http or s3 source to fill from (keys: {sorted(source)}); "
            "pvc and hostPath sources are mounted as they are"
        )
    body = source[kind]
    if not isinstance(body, Mapping):
        raise SourceSpecError(f"spec.model.{kind} must be an object, got {type(body).__name__}")
    if kind == "http":
        return HttpSource(HttpSourceConfig(_field(body, "http", "url"), policy=policy, limits=limits))
    ref = secret_ref_name(source)
    if ref is not None and credentials is None:
        raise SourceSpecError(f"spec.model.s3.secretRef names Secret {ref!r}: read it and pass its "
                              "credentials (credentials_from_secret_data)")
    ca_ref = ca_bundle_ref(source)
    if ca_ref is not None and ca_bundle is None:
        raise SourceSpecError(f"spec.model.s3.caBundle names Secret {ca_ref[0]!r}: read it and pass its "
                              "PEM text (ca_bundle_from_secret_data)")
    config = S3SourceConfig(
        endpoint=_field(body, "s3", "endpoint"),
        bucket=_field(body, "s3", "bucket"),
        prefix=_field(body, "s3", "prefix", required=False),
        credentials=credentials,
        region=_field(body, "s3", "region", required=False) or None,
        default_chain=default_chain and ref is None,
        ca_bundle=ca_bundle,
        policy=None if client is not None else policy,
        limits=limits,
    )
    return S3Source(config, client=client)
