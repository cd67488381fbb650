"""The operator's control key (rules/control_token.py): read from a Secret in the operator's own
namespace, or made there by the first replica that finds none.

Every replica reads the same Secret, so a new leader derives the tokens the last one wrote.  The
chart grants ``get`` on this one Secret by name, and ``create`` in that namespace, so that the
operator reads no other Secret anywhere.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Any

from warmpool.contract.pods import APP_NAME, LABEL_MANAGED_BY, LABEL_NAME, MANAGED_BY
from warmpool.kube import KubeError
from warmpool_operator.io.kube import SECRETS, Kube
from warmpool_operator.rules.control_token import KEY_BYTES

#: The Secret's key holding the control key (base64 of its bytes, as any Secret's data).
KEY_FIELD = "key"
#: Reads and creates before giving up on a Secret that keeps vanishing between the two.
_ATTEMPTS = 3


class ControlKeyError(RuntimeError):
    """The control key's Secret exists but holds no usable key; the message names it."""


def _key_of(secret: Mapping[str, Any], where: str) -> bytes:
    raw = (secret.get("data") or {}).get(KEY_FIELD)
    try:
        key = base64.b64decode(raw or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        key = b""
    if len(key) < KEY_BYTES:
        raise ControlKeyError(f"Secret {where} holds no control key of {KEY_BYTES} bytes under data.{KEY_FIELD} "
                              f"(found {len(key)} bytes): delete it to have the operator make a new one "
                              "(every worker's control token then changes)")
    return key


def key_secret(namespace: str, name: str, key: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            LABEL_NAME: APP_NAME, LABEL_MANAGED_BY: MANAGED_BY}},
        "data": {KEY_FIELD: base64.b64encode(key).decode()},
    }


async def load_or_create(kube: Kube, namespace: str, name: str) -> bytes:
    """The key in Secret ``namespace/name``; made (random) when there is none."""
    where = f"{namespace}/{name}"
    for _ in range(_ATTEMPTS):
        secret = await kube.get(SECRETS, namespace, name)
        if secret is not None:
            return _key_of(secret, where)
        key = secrets.token_bytes(KEY_BYTES)
        try:
            await kube.create(key_secret(namespace, name, key))
        except KubeError as error:
            if error.status == 409:
                continue  # another replica made it meanwhile: read theirs
            raise
        return key
    raise ControlKeyError(f"Secret {where} was made and gone again {_ATTEMPTS} times: is something deleting it?")
