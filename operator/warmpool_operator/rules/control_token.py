"""The workers' control token: derived from the operator's one key, so never read back.

Each WarmModel's token is ``base64url(HMAC-SHA256(key, "warmpool-control-v1" NUL namespace NUL
name NUL uid))``.  The operator writes it into the WarmModel's ``<name>-control`` Secret, which
its worker pods mount, and never reads that Secret again: it needs no ``get`` on Secrets outside
its own namespace, where the key lives (io/control_key.py).  A WarmModel made again under the same
name has another uid, so another token.  Rotating the key (deleting its Secret, then restarting
the operator) rotates every token: the operator writes the new ones as workers refuse the old.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

#: Bytes of a control key: HMAC-SHA256's own block of strength.
KEY_BYTES = 32
_CONTEXT = b"warmpool-control-v1"


def derive(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The control token of the WarmModel ``namespace/name`` whose uid is ``uid``."""
    if len(key) < KEY_BYTES:
        raise ValueError(f"a control key has at least {KEY_BYTES} bytes, this one {len(key)}")
    message = b"\0".join((_CONTEXT, namespace.encode(), name.encode(), uid.encode()))
    return base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode().rstrip("=")
