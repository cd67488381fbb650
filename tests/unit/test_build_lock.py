"""Two builds of the dev binaries at once take turns: the second waits for the first's lock (the
build folders are shared; a kube-apiserver built beside another build once lost its output)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from warmpool_devcluster.build import build_lock

pytestmark = pytest.mark.unit

WAIT_S = 30.0


def test_a_second_build_waits_for_the_first_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "build" / "lock"
    order: list[str] = []
    second_in = threading.Event()

    def second() -> None:
        with build_lock(lock):
            order.append("second")
            second_in.set()

    with build_lock(lock):
        order.append("first")
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not second_in.wait(0.5)  # the lock is held: the second build has not started
        order.append("first done")
    assert second_in.wait(WAIT_S), "the second build never got the lock"
    waiter.join(WAIT_S)
    assert order == ["first", "first done", "second"]
    assert f"waiting for another build to finish (it holds {lock})" in capsys.readouterr().err
    with build_lock(lock):  # free again: taken at once
        pass
