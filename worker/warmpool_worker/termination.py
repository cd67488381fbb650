"""The worker's last error, left where the kubelet reads it when the container exits.

A worker that cannot start (a weight file it may not read, a malformed checkpoint) logs why
and exits non-zero.  Kubernetes keeps the contents of the container's termination-message file
(``terminationMessagePath``, by default ``/dev/termination-log``) in the pod's
``lastState.terminated.message``; the operator carries that into the WarmModel's conditions, so
``kubectl describe wm`` says why without a trip to the pod's logs.  The log's own last line on
such an exit is "worker stopped (exit 1)", which says nothing: hence a file of its own, holding
the last error the worker logged.

The file is written only where it already exists: the kubelet makes it for the container; a
worker run outside a pod (a developer's shell, a test) has none, and nothing is created.
"""

from __future__ import annotations

import logging
from pathlib import Path

from warmpool.contract.pods import TERMINATION_MESSAGE_MAX_BYTES


def bounded(text: str, limit: int = TERMINATION_MESSAGE_MAX_BYTES) -> bytes:
    """``text`` as UTF-8 in at most ``limit`` bytes (the kubelet keeps no more), cut on a character
    boundary: its head, which names what failed, is what is kept."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return data
    return data[:limit].decode("utf-8", errors="ignore").encode("utf-8")


class LastError(logging.Handler):
    """Remembers the last record logged at ERROR or above, as its message (no traceback: the
    exception's own line is the part a person reads at a glance)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message = f"{message}: {type(error).__name__}: {error}"
        self.message = message


def write_termination_message(path: Path, message: str) -> bool:
    """Write ``message`` (bounded) to the termination-message file at ``path``, if the file exists;
    whether it was written.  A failure to write is logged, never raised: the exit it explains
    goes on."""
    if not path.is_file():
        return False
    try:
        path.write_bytes(bounded(message))
    except OSError as error:
        logging.getLogger("warmpool.worker").warning("cannot write the termination message to %s: %s", path, error)
        return False
    return True
