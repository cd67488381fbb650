"""The fill lease on real lock files: one holder at a time, versions only grow, and the publish fence."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_nodecache.file_lease import FileLease

from warmpool.lease import LeaseLostError

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _staging(tmp_path: Path, name: str) -> tuple[Path, Path]:
    staging = tmp_path / "staging" / name
    staging.mkdir(parents=True)
    (staging / "f").write_text(name)
    (tmp_path / "revisions").mkdir(exist_ok=True)
    return staging, tmp_path / "revisions" / "rev"


def test_one_holder_at_a_time_and_versions_grow_across_releases(tmp_path: Path) -> None:
    clock = Clock()
    first, second = (FileLease(tmp_path / "leases", "rev", 10.0, clock) for _ in range(2))
    assert first.try_acquire() and first.version == 1
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire() and second.version == 2
    assert second.read() is not None and second.read().holder == second.holder  # type: ignore[union-attr]


def test_an_expired_lease_cannot_publish_and_the_taker_over_can(tmp_path: Path) -> None:
    clock = Clock()
    slow, fresh = (FileLease(tmp_path / "leases", "rev", 10.0, clock) for _ in range(2))
    assert slow.try_acquire()
    clock.now += 11  # slow's TTL runs out
    staging, final = _staging(tmp_path, "slow")
    with pytest.raises(LeaseLostError, match="version 1 expired"):
        slow.publish(staging, final)
    assert not final.exists() and staging.is_dir()
    assert fresh.try_acquire() and fresh.version == 2  # a stale lease is taken over, one version up
    with pytest.raises(LeaseLostError, match="taken over"):
        slow.renew()
    with pytest.raises(LeaseLostError, match="taken over"):
        slow.publish(staging, final)
    fresh_staging, _ = _staging(tmp_path, "fresh")
    fresh.publish(fresh_staging, final)
    assert (final / "f").read_text() == "fresh"
    slow.release()  # a lost lease's release leaves the new holder's alone
    assert fresh.read() is not None and fresh.read().version == 2  # type: ignore[union-attr]


def test_renewal_keeps_a_lease_alive_past_its_first_ttl(tmp_path: Path) -> None:
    clock = Clock()
    lease, rival = (FileLease(tmp_path / "leases", "rev", 10.0, clock) for _ in range(2))
    assert lease.try_acquire()
    clock.now += 8
    lease.renew()
    clock.now += 8
    assert not rival.try_acquire()
    staging, final = _staging(tmp_path, "x")
    lease.publish(staging, final)
    assert final.is_dir()
