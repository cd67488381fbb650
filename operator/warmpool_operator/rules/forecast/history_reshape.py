"""Copies of a :class:`~.history.History` in another shape (pure): its newest part only (what the
store keeps when the whole does not fit a ConfigMap), or re-held at other limits (what an operator
upgrade or a new ``--predict-step-seconds`` reads an older stored history as).

:func:`adapted` keeps all it can of a history at other limits:

- the **fine steps** when the step is the same (the newest ones its retention holds); a history at
  another step cannot be cut into this one's, so its fine steps start empty;
- the **coarse tier** from the stored coarse tier when its step is the same, else rolled up from the
  stored fine steps when the coarse step is a whole multiple of theirs (an older operator's 60 s
  single-resolution week becomes a week of 5 min steps: its weekly and daily shape survive the
  upgrade); the newest steps that its retention holds.
"""

from __future__ import annotations

from warmpool_operator.rules.forecast.history import History, HistoryLimits, resampled


def _tail(history: History, count: int, limits: HistoryLimits) -> History:
    """The newest ``count`` (0 included) steps of ``history`` (no coarse tier), held at ``limits``,
    with the length histograms of their slots (the slot of the first one whole: a slot is their
    resolution)."""
    start = history.end - count
    first_slot = start * history.limits.step_s // history.limits.slot_s
    keep = slice(len(history) - count, None)
    return History(limits=limits, start=start if count else 0, requests=history.requests[keep],
                   prompt_tokens=history.prompt_tokens[keep], generated_tokens=history.generated_tokens[keep],
                   prompt_hist={s: list(c) for s, c in history.prompt_hist.items() if count and s >= first_slot},
                   generated_hist={s: list(c) for s, c in history.generated_hist.items() if count and s >= first_slot},
                   peak_requests=history.peak_requests[keep])


def since(history: History, first_step: int) -> History:
    """A copy holding only the steps from fine step ``first_step`` on: the fine steps at or after it, and
    the coarse steps that begin at or after it (``first_step`` may be older than the fine steps held)."""
    fine = _tail(history, max(0, min(len(history), history.end - first_step)), history.limits.fine)
    coarse = history.coarse
    if coarse is None:
        return fine
    k = coarse.limits.step_s // history.limits.step_s
    first_group = -(-first_step // k)
    kept = _tail(coarse, max(0, min(len(coarse), coarse.end - first_group)), coarse.limits)
    return _with_coarse(fine, history.limits, kept)


def _with_coarse(fine: History, limits: HistoryLimits, coarse: History | None) -> History:
    return History(limits=limits, start=fine.start, requests=fine.requests, prompt_tokens=fine.prompt_tokens,
                   generated_tokens=fine.generated_tokens, prompt_hist=fine.prompt_hist,
                   generated_hist=fine.generated_hist, peak_requests=fine.peak_requests, coarse=coarse)


def held_steps(history: History) -> int:
    """The steps ``history`` holds, its coarse tier's included."""
    return len(history) + (len(history.coarse) if history.coarse is not None else 0)


def oldest_step(history: History) -> int:
    """The oldest step held, in fine steps (the coarse tier reaches further back than the fine one)."""
    coarse = history.coarse
    if coarse is None or not len(coarse):
        return history.start
    k = coarse.limits.step_s // history.limits.step_s
    return min(history.start, coarse.start * k) if len(history) else coarse.start * k


def adapted(stored: History, limits: HistoryLimits) -> tuple[History, str]:
    """``stored`` re-held at ``limits`` (see the module docstring), and what was kept of it."""
    if stored.limits == limits:
        return stored, "kept whole"
    if stored.limits.slot_s != limits.slot_s:
        return History(limits=limits), (f"nothing kept: its length histograms are per {stored.limits.slot_s} s, "
                                        f"not {limits.slot_s} s")
    fine_kept = stored.limits.step_s == limits.step_s
    fine = _tail(stored, min(len(stored), limits.points) if fine_kept else 0, limits.fine)
    words = [f"{len(fine)} of its {len(stored)} {stored.limits.step_s} s steps kept"
             + ("" if fine_kept else f" (a {stored.limits.step_s} s step cannot be held at {limits.step_s} s)")]
    wanted = limits.coarse
    coarse: History | None = None
    if wanted is not None:
        source, where = _coarse_source(stored, wanted.step_s)
        coarse = History(limits=wanted) if source is None else _tail(source, min(len(source), wanted.points), wanted)
        words.append(f"{len(coarse)} coarse {wanted.step_s} s steps {where}")
    return _with_coarse(fine, limits, coarse), "; ".join(words)


def _coarse_source(stored: History, step_s: int) -> tuple[History | None, str]:
    """Where coarse steps of ``step_s`` come from, and how it says so: the stored coarse tier (resampled
    if it must be: it reaches further back), else the stored fine steps rolled up; None when neither
    divides ``step_s``."""
    for tier, where in ((stored.coarse, "from its coarse tier"), (stored, "rolled up from its steps")):
        if tier is None:
            continue
        own = tier.limits.step_s
        if step_s >= own and step_s % own == 0:
            return resampled(tier, step_s), where
    return None, f"(its {stored.limits.step_s} s steps do not divide them)"
