"""When the operator asks for a resync (registry.Registry.saw): a watch listing an object it had
already shown has listed again, and what it deleted meanwhile got no event."""

from __future__ import annotations

import pytest
from warmpool_operator.control.registry import Registry

pytestmark = pytest.mark.unit


def _registry() -> Registry:
    return Registry(kube=None, workers=None, scheduler=None)  # type: ignore[arg-type]


def test_the_first_listing_and_live_events_ask_for_nothing() -> None:
    registry = _registry()
    for uid in ("a", "b"):
        registry.saw(None, uid)  # the start-up listing
    registry.saw("ADDED", "c")
    registry.saw("MODIFIED", "a")
    assert not registry.resync_wanted.is_set()


def test_an_object_listed_again_asks_for_a_resync() -> None:
    registry = _registry()
    registry.saw(None, "a")
    registry.saw("ADDED", "c")
    registry.saw(None, "c")  # made after start-up, then listed: that watch listed again
    assert registry.resync_wanted.is_set()


def test_a_deleted_object_is_forgotten() -> None:
    registry = _registry()
    registry.saw(None, "a")
    registry.saw("DELETED", "a")
    registry.saw(None, "a")
    assert not registry.resync_wanted.is_set()
    assert registry.known == {"a"}
