"""Where things live under a cache root (one place, so every module agrees).

    <root>/blocks/<aa>/<sha256 hex>      a block file, read-only, sharded by the first two hex digits: only
                                         blocks fetched on their own (safetensors headers); a fill's blocks
                                         live in its revision's files (blocks.py)
    <root>/manifests/<digest hex>.json   the manifest of a revision being filled or published
    <root>/staging/<digest hex>.<version> a fill's revision directory before it is published (a partial
                                         view's progress record inside it: warmpool.fill_progress)
    <root>/staging/<digest hex>.<version>.done  its journal: the blocks durable in it (journal.py)
    <root>/revisions/<digest hex>/       a published revision: the model's files, complete
    <root>/domains/<domain>/             what one trust domain (a namespace) may use (trust.py):
        revisions/<digest hex>           symlink to a published revision the domain verified itself
        partial/<digest hex>             symlink to the domain's fill's partial view, then to the revision
        blocks/<aa>/<sha256 hex>         empty: the domain fetched and verified this block itself
    <root>/leases/<digest hex>.lease     the fill lease of a revision (and .lock, its mutex)
    <root>/uses/<digest hex>             one line per use of a revision (LRU-K history)
    <root>/pins/<digest hex>/<pid>.<n>   a reader's pin: that process is using the revision
    <root>/gc.lock                       fills hold it shared, eviction exclusive
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool.contract.nodecache import (
    CACHE_DOMAINS_DIR,
    CACHE_GRANTED_DIR,
    CACHE_PARTIAL_DIR,
    CACHE_REVISIONS_DIR,
)

#: The trust domain of fills no namespace asked for (``python -m warmpool_nodecache fill``, the
#: benches): not a namespace name (those never hold "_"), so no tenant's WarmModel shares it.
DEFAULT_DOMAIN = "_node"
_DOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_domain(domain: str) -> str:
    """`domain` when it names a trust domain (a namespace name, or DEFAULT_DOMAIN); ValueError otherwise."""
    if domain != DEFAULT_DOMAIN and not _DOMAIN_RE.fullmatch(domain):
        raise ValueError(f"trust domain {domain!r} is not a namespace name (a DNS-1123 label)")
    return domain


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
    def domains(self) -> Path:
        return self.root / CACHE_DOMAINS_DIR

    def domain(self, domain: str) -> Path:
        return self.domains / check_domain(domain)

    def granted_link(self, digest_hex: str, domain: str = DEFAULT_DOMAIN) -> Path:
        """The domain's link to a published revision it verified itself (what its pods mount)."""
        return self.domain(domain) / CACHE_GRANTED_DIR / digest_hex

    def partial_link(self, digest_hex: str, domain: str = DEFAULT_DOMAIN) -> Path:
        """The domain's link to its fill's partial view of a revision, then to the revision."""
        return self.domain(domain) / CACHE_PARTIAL_DIR / digest_hex

    def vouched(self, sha256: str, domain: str = DEFAULT_DOMAIN) -> Path:
        """The mark saying the domain fetched and verified this block itself."""
        return self.domain(domain) / "blocks" / sha256[:2] / sha256

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
