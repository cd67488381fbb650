"""Where warmpool's developer-side caches live on this machine (never read inside a pod).

One root holds everything the local tools build or fetch once and reuse: the control
plane's binaries (``bin/``), local clusters (``clusters/``), models (``models/``), the
demo's state (``demo/``).  The local control plane, the model fetch, the benchmarks and
the tests all take it from here, so one environment variable moves all of it.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Overrides the cache root (a CI cache directory, a scratch disk, a test's temp dir).
ENV_CACHE_DIR = "WARMPOOL_CACHE_DIR"


def cache_root() -> Path:
    """``$WARMPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/warmpool``, else ``~/.cache/warmpool``."""
    base = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "warmpool"
    )
    return Path(base)


def models_root() -> Path:
    """Where fetched and generated models are cached (``<cache root>/models``)."""
    return cache_root() / "models"
