"""The worker's local tier guard, and the operator's directive.

A fast loop (default every 0.5 s) reads the memory probe and applies the shared tier rule
(`warmpool.tiering.decide_tier`, with hysteresis).  The operator, which sees the whole node
and pool, may send a directive through the control endpoint; the effective tier is the
stricter of the two.  A directive holds for its TTL only: if the operator stops re-sending
(crashed, partitioned), the worker falls back to its own view instead of staying pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from warmpool_worker.defaults import DEFAULT_GUARD_INTERVAL_S
from warmpool_worker.memory import MemoryProbe, MemoryReading

from warmpool.contract.api import DIRECTIVE_TIERS, MAX_DIRECTIVE_TTL_SECONDS, Tier
from warmpool.tiering import Thresholds, decide_tier, stricter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardState:
    effective: Tier
    local: Tier
    directive: Tier | None  # None when none holds
    directive_expires_in: float | None
    reading: MemoryReading | None

    def describe(self) -> dict[str, object]:
        return {
            "tier": self.effective.value,
            "local_tier": self.local.value,
            "directive": None if self.directive is None else self.directive.value,
            "directive_expires_in_s": None
            if self.directive_expires_in is None
            else round(self.directive_expires_in, 1),
            "memory": None
            if self.reading is None
            else {
                "used_bytes": self.reading.used_bytes,
                "capacity_bytes": self.reading.capacity_bytes,
                "ratio": round(self.reading.ratio, 4),
                "source": self.reading.source,
            },
        }


class TierGuard:
    """Thread-safe: `tick` runs off the event loop (the probe reads /proc), directives arrive on it."""

    def __init__(
        self,
        probe: MemoryProbe,
        thresholds: Thresholds,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[GuardState], None] | None = None,
    ) -> None:
        self.probe = probe
        self.thresholds = thresholds
        self.clock = clock
        self.on_update = on_update
        self._lock = threading.Lock()
        self._local = Tier.UNKNOWN
        self._last_known = Tier.UNKNOWN  # hysteresis memory survives a missed reading
        self._reading: MemoryReading | None = None
        self._directive: Tier | None = None
        self._directive_until = 0.0
        self._ticked = threading.Event()

    def _state_locked(self) -> GuardState:
        now = self.clock()
        directive = self._directive if self._directive is not None and now < self._directive_until else None
        if directive is None and self._directive is not None:
            log.info("operator directive %s expired: back to the local tier", self._directive.value)
            self._directive = None
        effective = self._local if directive is None else stricter(self._local, directive)
        return GuardState(
            effective=effective,
            local=self._local,
            directive=directive,
            directive_expires_in=None if directive is None else self._directive_until - now,
            reading=self._reading,
        )

    @property
    def state(self) -> GuardState:
        with self._lock:
            return self._state_locked()

    def tick(self) -> GuardState:
        """Read the probe once and re-decide."""
        try:
            reading = self.probe.read()
        except Exception as error:  # a probe bug must not kill the guard: Unknown, and say so
            log.warning("memory probe failed: %s", error)
            reading = None
        with self._lock:
            self._reading = reading
            local = decide_tier(None if reading is None else reading.ratio, self._last_known, self.thresholds)
            if local is not self._local:
                log.info(
                    "local tier %s -> %s (memory %s)",
                    self._local.value,
                    local.value,
                    "unknown" if reading is None else f"{reading.ratio:.1%} via {reading.source}",
                )
            self._local = local
            if local is not Tier.UNKNOWN:
                self._last_known = local
            state = self._state_locked()
        self._ticked.set()
        if self.on_update is not None:
            self.on_update(state)
        return state

    def set_directive(self, tier: Tier, ttl_seconds: float) -> GuardState:
        if tier not in DIRECTIVE_TIERS:
            raise ValueError(f"tier must be one of {[t.value for t in DIRECTIVE_TIERS]}, got {tier.value!r}")
        if not 0 < ttl_seconds <= MAX_DIRECTIVE_TTL_SECONDS:
            raise ValueError(
                f"ttl_seconds must be within (0, {MAX_DIRECTIVE_TTL_SECONDS:g}], got {ttl_seconds}"
            )
        with self._lock:
            if tier is not self._directive:
                log.info("operator directive: %s for %.0fs", tier.value, ttl_seconds)
            self._directive = tier
            self._directive_until = self.clock() + ttl_seconds
            state = self._state_locked()
        if self.on_update is not None:
            self.on_update(state)
        return state

    def wait_first_tick(self, timeout: float) -> bool:
        return self._ticked.wait(timeout)

    async def run(self, stop: asyncio.Event, interval: float = DEFAULT_GUARD_INTERVAL_S) -> None:
        """Tick until `stop` is set (the probe runs in a thread: it reads /proc, possibly NVML)."""
        while not stop.is_set():
            await asyncio.to_thread(self.tick)
            with contextlib.suppress(TimeoutError):  # the interval passed: tick again
                await asyncio.wait_for(stop.wait(), timeout=interval)
