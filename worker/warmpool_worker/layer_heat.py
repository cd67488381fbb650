"""Per-layer heat: access counts that decay exponentially with time (higher is hotter).

Shared by every engine that reports `Engine.layer_heat()`: the built-in engine touches a
layer each time a forward pass runs it; an engine that only knows whole passes touches all.
Torch-free, so engines without torch use it too.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

DEFAULT_HEAT_HALF_LIFE_S = 300.0


class LayerHeat:
    """Each layer holds (value decayed to the time of its last update, that time)."""

    def __init__(self, num_layers: int, half_life_s: float = DEFAULT_HEAT_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._half_life_s = half_life_s
        self._clock = clock
        now = clock()
        self._heat: list[tuple[float, float]] = [(0.0, now) for _ in range(num_layers)]
        self._lock = threading.Lock()

    def _decay(self, value: float, since: float, now: float) -> float:
        if self._half_life_s <= 0:  # no decay: plain access counts
            return value
        return value * math.pow(0.5, max(0.0, now - since) / self._half_life_s)

    def touch(self, index: int) -> None:
        """One access of this layer, now."""
        now = self._clock()
        with self._lock:
            value, since = self._heat[index]
            self._heat[index] = (self._decay(value, since, now) + 1.0, now)

    def touch_all(self) -> None:
        """One access of every layer at the same instant (a pass that skips Python per layer)."""
        now = self._clock()
        with self._lock:
            self._heat = [(self._decay(value, since, now) + 1.0, now) for value, since in self._heat]

    def snapshot(self) -> dict[int, float]:
        """Layer index -> heat decayed to now."""
        now = self._clock()
        with self._lock:
            return {index: self._decay(value, since, now) for index, (value, since) in enumerate(self._heat)}
