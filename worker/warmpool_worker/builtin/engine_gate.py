"""The one gate that decides who uses the engine: the batch's steps, or one exclusive user.

Exclusive users are the warm-up's steps (a layer load, a prefill), a check prefill, sleep and
wake.  Each holds the engine for one short step, and the batch steps between them; an
exclusive user waiting goes before the batch's next step (a plain lock gives no such order:
the scheduler, releasing and re-taking it in a loop, would starve the others).

Because sleep and the batch's admission both decide under this gate, a request is never
admitted to a sleeping engine and sleep never begins while a generation runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from warmpool_worker.engine_api import Engine, Sleepable


class EngineAsleep(Exception):
    """An exclusive step that needs the engine awake found it asleep (a warm-up top-up)."""


class EngineGate:
    """``with gate:`` is exclusive use (it can be entered again and again, like a lock);
    ``with gate.step():`` is the batch's turn, taken only while no exclusive user holds or
    waits for the gate."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False  # by an exclusive user
        self._waiting = 0  # exclusive users waiting
        self._stepping = False

    def __enter__(self) -> EngineGate:
        with self._cond:
            self._waiting += 1
            try:
                while self._held or self._stepping:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._held = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        with self._cond:
            while self._held or self._waiting:
                self._cond.wait()
            self._stepping = True
        try:
            yield
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()


class AwakeOnly:
    """Exclusive use of `gate` for a step that must not run on a sleeping engine: entered, it
    checks the sleep state under the gate (so no sleep can slip in between the check and the
    step) and raises EngineAsleep instead of running."""

    def __init__(self, gate: EngineGate, engine: Engine) -> None:
        self._gate = gate
        self._engine = engine

    def __enter__(self) -> AwakeOnly:
        self._gate.__enter__()
        engine = self._engine
        if isinstance(engine, Sleepable) and engine.sleep_level is not None:
            self._gate.__exit__(None, None, None)
            raise EngineAsleep("the engine went to sleep: warm-up steps wait for a wake")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._gate.__exit__(kind, error, trace)
