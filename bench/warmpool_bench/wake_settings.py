"""`warmpool bench wake`'s settings and variant names: what wake.py runs and wake_pod.py reads
(their own module, so the two import neither each other nor in a circle)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from warmpool_bench.coldstart import Settings

#: variant -> (worker, sleep level, what wakes it); worker "served" runs at --dtype, "copies" in float32.
WAKE_VARIANTS: dict[str, tuple[str, int, str]] = {
    "wake_l1": ("served", 1, "control"),
    "wake_l2": ("served", 2, "control"),
    "request_wake_l1": ("served", 1, "request"),
    "request_wake_l2": ("served", 2, "request"),
    "copies_wake_l1": ("copies", 1, "control"),
    "copies_wake_l2": ("copies", 2, "control"),
}
VARIANTS = (*WAKE_VARIANTS, "fresh_process", "new_pod")


@dataclass
class WakeSettings:
    rounds: int = 5
    dtype: str = "bfloat16"
    buckets: tuple[int, ...] = (32, 128, 512)
    prompts_per_bucket: int = 1
    decode_tokens: int = 4
    request_tokens: int = 128
    steady: int = 3
    timeout_s: float = 600.0
    threads: int | None = 1
    variants: tuple[str, ...] = VARIANTS
    #: a running local real-node cluster to use (default: the run starts one of its own)
    cluster: str | None = None
    work_dir: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")) / "warmpool-bench")

    def coldstart(self, dtype: str | None = None) -> Settings:
        """The same worker settings in `bench coldstart`'s terms (its worker command and run)."""
        return Settings(runs=1, dtype=dtype or self.dtype, buckets=self.buckets,
                        prompts_per_bucket=self.prompts_per_bucket, decode_tokens=self.decode_tokens,
                        request_tokens=self.request_tokens, steady=self.steady, timeout_s=self.timeout_s,
                        threads=self.threads, variants=("warmpool_full",), cache_states=("warm",),
                        work_dir=self.work_dir)
