"""Cuts of a forecast history for tests: what the store's bisection is checked against."""

from __future__ import annotations

from warmpool_operator.rules.forecast.history import History
from warmpool_operator.rules.forecast.history_reshape import since


def newest_steps(history: History, count: int) -> History:
    """A copy holding only the newest ``count`` fine steps (and the coarse steps from then on)."""
    if not 0 < count <= len(history):
        raise ValueError(f"count must be within 1..{len(history)}, got {count}")
    return since(history, history.end - count)
