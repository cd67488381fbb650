"""The fast reactive loop beside the forecast (pure): pods for the arrival rate of the last few
seconds, every pass, so what the forecast missed is answered within a scrape or two, not a step.

NVIDIA Dynamo's planner pairs its slow predictive loop with a 5 s reactive one; ``bench predict``'s
burst-scale policy does the same (bench/warmpool_bench/predict_policies.py).  Here: ⌈requests the
workers' counters moved by in the last :data:`WINDOW_S` ÷ the window ÷ the measured per-pod
capacity⌉.  No capacity measured: no ask (there is nothing to size by).  A pool at zero has no
counters moving: requests held at zero are the activator's, answered by the scale-to-zero path.
"""

from __future__ import annotations

import math

#: The arrival rate the loop reads: the shortest burst worth a pod (the bursts last 10-30 s).
WINDOW_S = 10.0


def fast_ask(requests_in_window: float, capacity_rps: float | None, window_s: float = WINDOW_S) -> int | None:
    """Pods for ``requests_in_window`` arrivals over ``window_s`` at ``capacity_rps`` per pod, or None
    when the capacity is not measured."""
    if window_s <= 0:
        raise ValueError(f"the window must be > 0 s, got {window_s}")
    if capacity_rps is None or not math.isfinite(capacity_rps) or capacity_rps <= 0:
        return None
    rate = max(0.0, requests_in_window) / window_s
    # The epsilon keeps a float division that lands a hair above a whole number from adding a pod.
    return max(0, math.ceil(rate / capacity_rps - 1e-9))
