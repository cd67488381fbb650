"""The sidecar's page-cache prefetch of the engine's weight files, hottest layers first.

`WeightPrefetch.prepare` maps the weight files (headers only) and orders the layers by the
heat map when it fits this checkpoint; `WeightPrefetch.run` prefetches the tier's share
(`prefetch.plan_prefetch`), re-plans when the tier tightens and tops up when it relaxes.
A prefetch failure is logged and reported on /readyz, never fatal: the engine reads its
weights either way, only slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

from warmpool_worker.config import SidecarConfig
from warmpool_worker.guard import TierGuard
from warmpool_worker.metrics import SidecarMetrics
from warmpool_worker.prefetch import Prefetcher, PrefetchReport, PrefetchStopped, WeightMap, map_weights, plan_prefetch

from warmpool.contract.api import Tier
from warmpool.heatmap import layer_order, usable_heat

log = logging.getLogger("warmpool.sidecar")


class WeightPrefetch:
    """The prefetch of one sidecar: its weight map, layer order and the loop that runs it."""

    def __init__(self, config: SidecarConfig, guard: TierGuard, metrics: SidecarMetrics, stop: asyncio.Event) -> None:
        self.config = config
        self.guard = guard
        self.metrics = metrics
        self.stop = stop
        self.cancel = threading.Event()  # stops a prefetch running in its thread
        self.order: list[int] = []  # layers, hottest first (forward order without a usable heat map)
        self.weights: WeightMap | None = None
        self.prefetcher: Prefetcher | None = None

    @property
    def active(self) -> bool:
        """Whether there are weights to prefetch (a --model-dir, and --prefetch on)."""
        return self.prefetcher is not None and self.config.prefetch

    @property
    def num_layers(self) -> int | None:
        return None if self.weights is None else self.weights.num_layers

    def describe(self) -> dict[str, object] | None:
        return None if self.prefetcher is None else self.prefetcher.report.describe()

    def prepare(self, model_dir: Path) -> None:
        """Blocking: the weight map and the heat order (cheap: headers only)."""
        self.weights = map_weights(model_dir)
        for problem in self.weights.errors:
            log.warning("prefetch: %s", problem)
        self.order = self._heat_order(model_dir, self.weights.num_layers)
        self.prefetcher = Prefetcher(self.weights, mode=self.config.prefetch_mode)
        self.metrics.set_layers(0, self.weights.num_layers)
        self.metrics.set_prefetch(self.prefetcher.report, len(self.weights.errors))

    def _heat_order(self, model_dir: Path, num_layers: int) -> list[int]:
        # The digest costs a read of every header: only worth it when there is a map to check.
        digest = _checkpoint_digest(model_dir) if self.config.heat_map is not None else None
        return layer_order(usable_heat(self.config.heat_map, digest, num_layers), num_layers)

    async def run(self) -> None:
        """Prefetch at the current tier; re-plan when it tightens, top up when it relaxes."""
        prefetcher, weights = self.prefetcher, self.weights
        if prefetcher is None or weights is None or not self.config.prefetch:
            return  # `supervise` marks weights_mapped when the engine answers (it has mapped them)
        file_errors = len(weights.errors)

        def on_progress(report: PrefetchReport) -> None:
            self.metrics.set_prefetch(report, file_errors)
            self.metrics.set_layers(report.layers_done, weights.num_layers)

        while not self.stop.is_set():
            tier = self.guard.state.effective
            groups = plan_prefetch(weights, tier, self.order, self.config.warmup.hot_layer_percent)

            def should_stop(tier: Tier = tier) -> bool:
                return self.cancel.is_set() or self.guard.state.effective.strictness > tier.strictness

            try:
                await asyncio.to_thread(prefetcher.run, groups, tier, should_stop, on_progress)
                self.metrics.mark_phase("weights_mapped")
            except PrefetchStopped:
                log.info("prefetch at tier %s cut short: the tier became stricter", tier.value)
                continue
            except Exception as error:  # a prefetch bug must never take readiness down with it
                log.exception("prefetch failed")
                prefetcher.report.errors.append(f"prefetch failed: {error}")
                prefetcher.report.state = "failed"
                return
            with contextlib.suppress(TimeoutError):  # then watch for a relaxed tier
                await asyncio.wait_for(self.stop.wait(), timeout=self.config.guard.interval_s)


def _checkpoint_digest(model_dir: Path) -> str | None:
    """The built-in engine's model digest (heat maps are keyed by it), when the reader accepts the dir."""
    from warmpool_worker.checkpoint import open_checkpoint
    from warmpool_worker.engine_api import ModelLoadError

    try:
        return open_checkpoint(model_dir).digest
    except (ModelLoadError, OSError) as error:
        log.info("no model digest for %s: %s", model_dir, error)
        return None
