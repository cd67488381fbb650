"""The activator's part in `bench predict --live`'s pools from zero.

The load generator holds the requests that arrive while a pool has no warm pod; this reports how many, as
one activator replica does (the ``held.warmpool.dev/<replica>`` annotation on the WarmModel,
warmpool/contract/zero.py), so the operator raises a pool at zero for the replay's traffic as it would for
real traffic.  The same write rules as the activator's (operator/.../activator/demand.py): a count that
rises from zero is written at once, later changes coalesced, the value rewritten while requests stay held,
and the key removed once nothing is held.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from warmpool_operator.activator.demand import COALESCE_SECONDS, REFRESH_SECONDS

from warmpool.contract.api import API_GROUP, API_VERSION, PLURAL
from warmpool.contract.zero import held_annotation, held_value

#: The replica name the generator reports under (one key beside any real activator's).
REPLICA = "bench-load-generator"


@dataclass
class HeldReporter:
    """Start with :meth:`start`, always :meth:`stop` (it removes the key)."""

    custom: Any  # kubernetes.client.CustomObjectsApi
    namespace: str
    name: str
    writes: int = 0
    errors: list[str] = field(default_factory=list)
    _count: int = 0
    _written: int = 0
    _written_at: float = 0.0
    _stopping: bool = False
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def set(self, count: int) -> None:
        """The requests held now (the generator calls this on every dispatch round)."""
        with self._changed:
            if count != self._count:
                self._count = count
                self._changed.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"held {self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self._written:
            self._write(0)

    def _due(self) -> bool:
        stale = self._count > 0 and time.monotonic() - self._written_at >= REFRESH_SECONDS
        return self._count != self._written or stale

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._stopping and not self._due():
                    self._changed.wait(timeout=1.0)
                if self._stopping:
                    return
                count = self._count
            self._write(count)
            time.sleep(COALESCE_SECONDS)  # a burst of arrivals: one write, not one each

    def _write(self, count: int) -> None:
        value = held_value(count, time.time()) if count else None
        body = {"metadata": {"annotations": {held_annotation(REPLICA): value}}}
        try:
            self.custom.patch_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, self.name,
                                                       body, _request_timeout=10)
        except Exception as error:  # the next round writes again; the bench reports what failed
            self.errors.append(f"{type(error).__name__}: {str(error)[:200]}")
            time.sleep(0.5)
            return
        self.writes += 1
        self._written, self._written_at = count, time.monotonic()
