"""A WarmModel's ``spec.model`` (as a plain dict) -> the fill `Source` it names.

This is the node agent's entry point to the sources::

    source = source_from_spec(wm["spec"]["model"]["source"], credentials=creds)
    fill_revision(layout, source, ...)

Accepted shapes (camelCase, as in the WarmModel; exactly one of the two keys)::

    {"http": {"url": "http://host/models/x"}}
    {"s3": {"endpoint": "http://127.0.0.1:8333", "bucket": "models", "prefix": "smollm2/r1",
            "secretRef": "models-s3"}}          # or secretRef: {"name": "models-s3"}; optional

The agent reads the Secret that `secret_ref_name` returns (keys
``contract.S3_SECRET_ACCESS_KEY_ID_KEY`` / ``S3_SECRET_SECRET_ACCESS_KEY_KEY``), turns its
``.data`` into credentials with `credentials_from_secret_data`, and passes them in; this
module does no Kubernetes I/O.  An s3 source without secretRef is read unsigned (a public
bucket).  Anything else (pvc, hostPath, both keys, a missing field) is a SourceSpecError
naming the field.  Building a source makes no request.

A source built from a spec is always guarded: its reads go only to addresses ``policy`` accepts
(by default an ``AddressPolicy`` that refuses loopback, link-local and host-internal ranges; the
node agent passes its own, with the cluster's networks) and stay within ``limits``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from warmpool.contract.files import S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig
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


def credentials_from_secret_data(data: Mapping[str, str | bytes], secret: str = "the Secret") -> S3Credentials:
    """Credentials from a Secret's ``.data`` (base64 values, as the API returns them)."""
    values: dict[str, str] = {}
    for key in (S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY):
        raw = data.get(key)
        if not raw:
            raise SourceSpecError(f"{secret} has no {key!r} key (it needs {S3_SECRET_ACCESS_KEY_ID_KEY} and "
                                  f"{S3_SECRET_SECRET_ACCESS_KEY_KEY})")
        try:
            values[key] = base64.b64decode(raw, validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            raise SourceSpecError(f"{secret}: {key!r} is not base64 of UTF-8 text") from None
    return S3Credentials(values[S3_SECRET_ACCESS_KEY_ID_KEY], values[S3_SECRET_SECRET_ACCESS_KEY_KEY])


def source_from_spec(
    source: Mapping[str, Any], *, credentials: S3Credentials | None = None, client: Any = None,
    policy: AddressPolicy = DEFAULT_POLICY, limits: ReadLimits | None = None,
) -> Source:
    """The Source for `source` (a WarmModel's spec.model dict); see the module's docstring.

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
    config = S3SourceConfig(
        endpoint=_field(body, "s3", "endpoint"),
        bucket=_field(body, "s3", "bucket"),
        prefix=_field(body, "s3", "prefix", required=False),
        credentials=credentials,
        policy=None if client is not None else policy,
        limits=limits,
    )
    return S3Source(config, client=client)
