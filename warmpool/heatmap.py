"""The layer heat map: which decoder layers are hottest, so new workers load them first.

The one definition of the format and of heat ordering: the operator writes the map
(``HeatMap.to_text``) and orders heat to see whether a rewrite is worth it, the worker and
the sidecar read it (``usable_heat``) and load layers in its order (``layer_order``).

File format (JSON, UTF-8; the operator writes it into the WarmModel's ConfigMap under the
key ``contract.CONFIGMAP_KEY_HEATMAP`` and the worker reads it from the mounted file)::

    {
      "format": "warmpool.heatmap/v1",       # contract.HEATMAP_FORMAT, required
      "model_digest": "sha256:...",          # Engine.model_digest the heat was measured on
      "num_layers": 30,                      # decoder layers of that model
      "updated_at": 1718000000.0,            # unix seconds of the last aggregation (optional)
      "heat": {"0": 12.5, "1": 3.0, ...}     # layer index (decimal string) -> heat >= 0
    }

``heat`` may be sparse: a missing layer has heat 0.  Heat is relative (access counts with
time decay, summed over workers by the operator); only the order matters.  A map whose
``model_digest`` or ``num_layers`` does not match the model being loaded is ignored
(heat of another model says nothing about this one), and so is a file that does not parse:
both fall back to the default order with a logged reason.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from warmpool.contract.files import HEATMAP_FORMAT

log = logging.getLogger(__name__)


class HeatMapError(ValueError):
    """A heat map file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class HeatMap:
    model_digest: str
    num_layers: int
    heat: dict[int, float] = field(default_factory=dict)
    updated_at: float | None = None

    def applies_to(self, model_digest: str, num_layers: int) -> str | None:
        """None if this map fits the model, else the reason it does not."""
        if self.model_digest != model_digest:
            return f"heat map is for model {self.model_digest!r}, not {model_digest!r}"
        if self.num_layers != num_layers:
            return f"heat map has {self.num_layers} layers, the model has {num_layers}"
        return None

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {
            "format": HEATMAP_FORMAT,
            "model_digest": self.model_digest,
            "num_layers": self.num_layers,
            "heat": {str(index): value for index, value in sorted(self.heat.items())},
        }
        if self.updated_at is not None:
            body["updated_at"] = self.updated_at
        return body

    def to_text(self) -> str:
        """The map as written to the ConfigMap and to files: compact JSON, keys sorted."""
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, body: object, source: str = "<heat map>") -> HeatMap:
        if not isinstance(body, dict):
            raise HeatMapError(f"{source}: expected a JSON object, got {type(body).__name__}")
        if body.get("format") != HEATMAP_FORMAT:
            raise HeatMapError(f"{source}: format is {body.get('format')!r}, expected {HEATMAP_FORMAT!r}")
        digest = body.get("model_digest")
        if not isinstance(digest, str) or not digest:
            raise HeatMapError(f"{source}: model_digest must be a non-empty string")
        num_layers = body.get("num_layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise HeatMapError(f"{source}: num_layers must be a non-negative integer, got {num_layers!r}")
        raw_heat = body.get("heat", {})
        if not isinstance(raw_heat, dict):
            raise HeatMapError(f"{source}: heat must be an object of layer index -> number")
        heat: dict[int, float] = {}
        for key, value in raw_heat.items():
            try:
                index = int(key)
            except ValueError:
                raise HeatMapError(f"{source}: layer key {key!r} is not an integer") from None
            if not 0 <= index < num_layers:
                raise HeatMapError(f"{source}: layer {index} out of range 0..{num_layers - 1}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise HeatMapError(f"{source}: heat of layer {index} is not a finite number: {value!r}")
            if value < 0:
                raise HeatMapError(f"{source}: heat of layer {index} is negative: {value!r}")
            heat[index] = float(value)
        updated_at = body.get("updated_at")
        if updated_at is not None and (
            isinstance(updated_at, bool) or not isinstance(updated_at, int | float)
        ):
            raise HeatMapError(f"{source}: updated_at must be a number of unix seconds")
        return cls(
            model_digest=digest,
            num_layers=num_layers,
            heat=heat,
            updated_at=None if updated_at is None else float(updated_at),
        )


def read_heatmap(path: Path) -> HeatMap:
    """Read and validate a heat map file; HeatMapError (naming the file) if unusable."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise HeatMapError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise HeatMapError(f"{path}: not JSON: {error}") from None
    return HeatMap.from_json(body, source=str(path))


def default_layer_order(num_layers: int) -> list[int]:
    """Forward order 0..N-1.

    Every token passes the layers in this order, so with no measured heat the layer that a
    first request needs soonest is loaded first, and each later layer has the most time to
    arrive (from the background load) before the forward pass reaches it.
    """
    return list(range(num_layers))


def usable_heat(path: Path | None, digest: str | None, num_layers: int) -> dict[int, float] | None:
    """The heat in the map at `path` if it applies to this checkpoint, else None (and why, logged).

    Shared by the built-in worker and the sidecar: a missing, unreadable or stale map only
    costs the load order, never the start.
    """
    if path is None:
        return None
    if digest is None:
        log.warning("heat map ignored: the model directory is not a checkpoint the built-in reader accepts")
        return None
    try:
        heat_map = read_heatmap(path)
    except HeatMapError as error:
        log.warning("heat map ignored: %s", error)
        return None
    mismatch = heat_map.applies_to(digest, num_layers)
    if mismatch is not None:
        log.warning("heat map ignored: %s", mismatch)
        return None
    return dict(heat_map.heat)


def layer_order(heat: Mapping[int, float] | None, num_layers: int) -> list[int]:
    """All layers, hottest first; ties (and layers with no heat) in forward order.

    Out-of-range indices and non-finite or negative heat are ignored (treated as no heat).
    """
    if not heat:
        return default_layer_order(num_layers)

    def score(index: int) -> float:
        value = heat.get(index, 0.0)
        return value if math.isfinite(value) and value > 0 else 0.0

    return sorted(range(num_layers), key=lambda index: (-score(index), index))


def hot_layers(order: Sequence[int], percent: float) -> list[int]:
    """The hottest ``percent`` % of ``order`` (rounded up; at least one layer when percent > 0)."""
    if not 0 <= percent <= 100:
        raise ValueError(f"hot layer percent must be within 0..100, got {percent}")
    if percent == 0 or not order:
        return []
    count = max(1, math.ceil(len(order) * percent / 100.0 - 1e-9))
    return list(order[:count])
