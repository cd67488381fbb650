"""Where things live under a cache root (one place, so every module agrees).

    <root>/blocks/<aa>/<sha256 hex>      one file per block, read-only, sharded by the first two hex digits
    <root>/manifests/<digest hex>.json   the manifest of a revision being filled or published
    <root>/staging/<digest hex>.<version> a fill's revision directory before it is published
    <root>/staging/<digest hex>.<version>.fill-progress.json  a partial view's progress record
                                         (warmpool.fill_progress; beside its view, the staging directory)
    <root>/revisions/<digest hex>/       a published revision: the model's files, complete
    <root>/partial/<digest hex>          symlink to a fill's partial view, then to the published revision
    <root>/leases/<digest hex>.lease     the fill lease of a revision (and .lock, its mutex)
    <root>/uses/<digest hex>             one line per use of a revision (LRU-K history)
    <root>/pins/<digest hex>/<pid>.<n>   a reader's pin: that process is using the revision
    <root>/gc.lock                       fills hold it shared, eviction exclusive
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool.contract.nodecache import CACHE_PARTIAL_DIR, CACHE_REVISIONS_DIR


@dataclass(frozen=True)
class CacheLayout:
    root: Path = Path(DEFAULT_BLOCK_CACHE_ROOT)

    @property
    def blocks(self) -> Path:
        return self.root / "blocks"

    def block(self, sha256: str) -> Path:
        return self.blocks / sha256[:2] / sha256

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    def manifest(self, digest_hex: str) -> Path:
        return self.manifests / f"{digest_hex}.json"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def revisions(self) -> Path:
        return self.root / CACHE_REVISIONS_DIR

    def revision(self, digest_hex: str) -> Path:
        return self.revisions / digest_hex

    @property
    def partial(self) -> Path:
        return self.root / CACHE_PARTIAL_DIR

    def partial_link(self, digest_hex: str) -> Path:
        return self.partial / digest_hex

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def uses(self) -> Path:
        return self.root / "uses"

    @property
    def pins(self) -> Path:
        return self.root / "pins"

    @property
    def gc_lock(self) -> Path:
        return self.root / "gc.lock"
