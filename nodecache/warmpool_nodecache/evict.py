"""Eviction: LRU-K (K=2) over revision uses, down to a size budget, never a revision in use.

A revision's eviction key is its K-th most recent use (``uses/<digest>``); a revision used fewer
than K times has none and goes first (LRU-K's rule: one use says little), ties broken by the
most recent use.  A revision is in use -- and never evicted -- while a live process holds a pin
on it (``use.pinned``) or maps one of its files (``/proc/*/maps``, see ``use.mapped_revisions``).
Removing a revision renames its directory away first (readers see it whole or not at all),
then frees every block file no remaining manifest references (the blocks held inside the
revision's files go with them: ``blocks.py``).  Size is disk usage (allocated bytes, each inode
once) of the block files and the revisions' files; reflinked extents count twice, which errs on
the side of evicting.  The whole pass runs under the cache-wide lock held exclusive,
so it waits for fills in progress (bounded) and leaves their blocks alone.

A cached manifest that no longer parses (a damaged disk, a hand edit) does not stop eviction:
its block files are freed as if it named none -- its revision's files do not need them (a clone
or copy has its own extents), so nothing published breaks,
and a later fill that needs those blocks fetches them again -- and the result names it, so the
agent can say so.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass

from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.eviction_lock import gc_lock
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import ManifestError, parse_manifest
from warmpool_nodecache.trust import forget
from warmpool_nodecache.use import live_pins, mapped_revisions, use_times

LRU_K = 2


@dataclass(frozen=True)
class EvictResult:
    evicted: tuple[str, ...]  # digests (hex), in eviction order
    in_use: tuple[str, ...]  # revisions kept because a process pins or maps them
    bytes_before: int
    bytes_after: int
    blocks_freed: int
    #: cached manifests (digest hex) that no longer parse; eviction went on without them
    unreadable: tuple[str, ...] = ()


def cache_bytes(layout: CacheLayout) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for top in (layout.blocks, layout.revisions):
        for dirpath, _, filenames in os.walk(top):
            for name in filenames:
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(dirpath, name))
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
    return total


def lru_k_key(times: list[float], k: int = LRU_K) -> tuple[float, float]:
    """Sort key, smallest evicted first: (K-th most recent use or -inf, most recent use or -inf)."""
    kth = times[-k] if len(times) >= k else -math.inf
    return (kth, times[-1] if times else -math.inf)


def _published(layout: CacheLayout) -> list[str]:
    if not layout.revisions.is_dir():
        return []
    return sorted(p.name for p in layout.revisions.iterdir() if p.is_dir())


def _drop_abandoned_fills(layout: CacheLayout, published: set[str]) -> None:
    """Manifests and staging of fills that died unpublished (no fill runs while we hold the lock exclusive)."""
    if layout.manifests.is_dir():
        for path in layout.manifests.glob("*.json"):
            if path.stem not in published:
                path.unlink()
    if layout.staging.is_dir():
        # Views (their progress records inside) and staged blocks.
        for path in layout.staging.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    for link in layout.domains.glob("*/partial/*"):
        if not link.exists():  # its view is gone: the fill died or failed
            with contextlib.suppress(FileNotFoundError):
                link.unlink()


def _free_unreferenced_blocks(layout: CacheLayout, unreadable: set[str], dropped: frozenset[str] = frozenset()) -> int:
    """Free every block no parsable cached manifest names; ``unreadable`` gains those that do not parse.
    ``dropped``: the blocks of a revision just evicted (held in its files, gone with them): the
    domains' marks of those no remaining manifest names go too."""
    referenced: set[str] = set()
    if layout.manifests.is_dir():
        for path in layout.manifests.glob("*.json"):
            try:
                referenced |= parse_manifest(path.read_bytes(), str(path)).unique_blocks()
            except ManifestError:
                unreadable.add(path.stem)  # see the module docstring: its revision does not need the names
            except FileNotFoundError:
                continue
    store = BlockStore(layout)
    unreferenced = store.all_blocks() - referenced
    for sha in unreferenced:
        store.remove(sha)
    forget(layout, unreferenced | (dropped - referenced))  # their marks (trust.py): marks stay bounded
    return len(unreferenced)


def _blocks_of(layout: CacheLayout, digest_hex: str) -> frozenset[str]:
    try:
        return frozenset(parse_manifest(layout.manifest(digest_hex).read_bytes()).unique_blocks())
    except (OSError, ManifestError):
        return frozenset()


def evict(
    layout: CacheLayout, budget_bytes: int, *, k: int = LRU_K, lock_timeout_s: float = 30.0,
    keep: frozenset[str] = frozenset(),
) -> EvictResult:
    """Evict revisions (LRU-K) until the cache fits `budget_bytes` or only revisions in use are left.

    ``keep``: digests (hex) counted as in use besides pins and maps -- the node agent's revisions
    that pods on its node need but may not have mapped yet."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    with gc_lock(layout, exclusive=True, timeout_s=lock_timeout_s):
        before = cache_bytes(layout)
        published = _published(layout)
        _drop_abandoned_fills(layout, set(published))
        unreadable: set[str] = set()
        freed = _free_unreferenced_blocks(layout, unreadable)
        mapped = mapped_revisions(layout)
        in_use = [d for d in published if d in keep or d in mapped or live_pins(layout, d)]
        candidates = sorted((d for d in published if d not in in_use), key=lambda d: lru_k_key(use_times(layout, d), k))
        evicted: list[str] = []
        size = cache_bytes(layout)
        for digest in candidates:
            if size <= budget_bytes:
                break
            dropped = _blocks_of(layout, digest)
            trash = layout.staging / f".evict-{digest}.{os.getpid()}"
            layout.staging.mkdir(parents=True, exist_ok=True)
            os.rename(layout.revision(digest), trash)
            shutil.rmtree(trash)
            for leftover in (layout.manifest(digest), layout.uses / digest):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            forget(layout, (), [digest])  # every domain's links to it
            shutil.rmtree(layout.pins / digest, ignore_errors=True)
            freed += _free_unreferenced_blocks(layout, unreadable, dropped)
            evicted.append(digest)
            size = cache_bytes(layout)
        return EvictResult(tuple(evicted), tuple(in_use), before, size, freed,
                           tuple(sorted(unreadable - set(evicted))))
