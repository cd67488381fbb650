"""Heat that learns: sum the workers' per-layer heat into the WarmModel's heat map.

The map is a JSON document in the ConfigMap, mounted into every worker pod; a new pod
loads the hottest layers first.  Its format and the heat order are :mod:`warmpool.heatmap`'s,
the module the worker reads it with.  Writes are rate-limited (``heat_write_interval``) and
skipped when the layer *order* — all a worker uses, computed as the worker computes it —
did not change, so a busy pool does not turn into a stream of ConfigMap updates.

Heat only applies to the checkpoint it was measured on: pods are grouped by the digest
their ``warmpool_model_info`` series names, and only the digest most pods run is kept
(during a rollout that is whichever revision is the majority).  No digest, no write.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from warmpool.heatmap import HeatMap, layer_order
from warmpool_operator.model import Sample


@dataclass
class HeatState:
    last_write: float = 0.0
    last_order: tuple[int, ...] | None = None


def aggregate(samples: Iterable[Sample]) -> tuple[str, int, dict[int, float]] | None:
    """(digest, num_layers, summed heat) over the pods running the majority checkpoint."""
    usable = [s for s in samples if s.ok and s.digest and s.num_layers and s.heat]
    if not usable:
        return None
    digest, _ = Counter(s.digest for s in usable).most_common(1)[0]
    group = [s for s in usable if s.digest == digest]
    num_layers = group[0].num_layers or 0
    heat: dict[int, float] = {}
    for sample in group:
        if sample.num_layers != num_layers:
            continue
        for layer, value in sample.heat.items():
            if 0 <= layer < num_layers:
                heat[layer] = heat.get(layer, 0.0) + value
    return (str(digest), num_layers, heat) if heat else None


def render(digest: str, num_layers: int, heat: dict[int, float], now: float) -> str:
    """The ConfigMap's heat map text (heat rounded: a pool's sums need no more digits)."""
    rounded = {layer: round(value, 6) for layer, value in heat.items()}
    return HeatMap(model_digest=digest, num_layers=num_layers, heat=rounded, updated_at=round(now, 3)).to_text()


def due(state: HeatState, samples: Iterable[Sample], interval: float, now: float | None = None) -> str | None:
    """The heat map to write now, or None (too soon, nothing learnt, or order unchanged)."""
    moment = time.time() if now is None else now
    if moment - state.last_write < interval:
        return None
    found = aggregate(samples)
    if found is None:
        return None
    digest, num_layers, heat = found
    order = tuple(layer_order(heat, num_layers))
    if order == state.last_order:
        return None
    return render(digest, num_layers, heat, moment)


def written(state: HeatState, payload: str, now: float | None = None) -> None:
    heat_map = HeatMap.from_json(json.loads(payload), source="the heat map just written")
    state.last_order = tuple(layer_order(heat_map.heat, heat_map.num_layers))
    state.last_write = time.time() if now is None else now
