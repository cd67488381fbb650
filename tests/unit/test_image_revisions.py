"""Which image revisions the dev tools remove from the build engine and the node's containerd,
so that a machine building revision after revision keeps a bounded cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_devcluster import images

pytestmark = pytest.mark.unit

W = "warmpool.local/worker"


def test_the_newest_revisions_stay_and_the_current_one_always() -> None:
    listed = [f"{W}:new", f"{W}:mid", f"{W}:old"]
    assert images.stale_revisions(listed, f"{W}:new", keep=2) == [f"{W}:old"]
    # An older revision asked for again (a checkout switched back) is kept before the newest ones.
    assert images.stale_revisions(listed, f"{W}:old", keep=2) == [f"{W}:mid"]
    assert images.stale_revisions(listed[:2], f"{W}:new", keep=2) == []
    assert images.stale_revisions(listed, None, keep=1) == [f"{W}:mid", f"{W}:old"]


def test_node_references_of_a_stale_revision_go_with_their_image_id() -> None:
    digests = {
        f"{W}:kept": "sha256:aaa", "sha256:id-kept": "sha256:aaa",
        f"{W}:stale": "sha256:bbb", "sha256:id-stale": "sha256:bbb",
        "warmpool.local/pause:p": "sha256:ccc", "sha256:id-pause": "sha256:ccc",
        "docker.io/other/team:1": "sha256:ddd", "sha256:id-other": "sha256:ddd",
    }
    assert images.stale_node_references(digests, {f"{W}:kept"}) == {f"{W}:stale", "sha256:id-stale"}


def test_an_id_another_name_still_holds_is_kept() -> None:
    # The same content tagged twice: one tag stale, the other kept; the content must stay.
    digests = {f"{W}:stale": "sha256:aaa", f"{W}:kept": "sha256:aaa", "sha256:id": "sha256:aaa"}
    assert images.stale_node_references(digests, {f"{W}:kept"}) == {f"{W}:stale"}


def test_a_build_without_room_is_refused_with_the_figures(tmp_path: Path) -> None:
    with pytest.raises(images.ImageError, match=r"building worker needs about 1e\+06 GiB free under .* GiB is"):
        images.check_free_space(tmp_path, 1e6, "building worker")
    images.check_free_space(tmp_path, 0.0001, "building worker")
