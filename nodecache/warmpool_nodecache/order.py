"""The order a fill fetches blocks in: hottest first, so a worker can start on a partial cache.

An order is a hook, ``BlockOrder``: given the manifest, the blocks to fetch first; the fill
fetches whatever it leaves out afterwards, in file order.  Two are built in: named files first
(``files_first``) and the heat map's layer order (``heat_block_order``), which needs where each
decoder layer's tensors lie in the files (``LayerRanges``, from the safetensors headers: the
node agent reads them from the first blocks it fetches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from warmpool.heatmap import layer_order
from warmpool_nodecache.manifest import BlockRef, Manifest, ManifestError

#: Given the manifest, the blocks in the order to fetch them (hottest first); blocks it leaves out follow in file order.
BlockOrder = Callable[[Manifest], Sequence[BlockRef]]
#: decoder layer index -> the (file path, first byte, end byte exclusive) spans its tensors occupy
LayerRanges = Mapping[int, Sequence[tuple[str, int, int]]]


def files_first(names: Sequence[str]) -> BlockOrder:
    """Fetch the named files' blocks first (in the order named), then the rest."""

    def order(manifest: Manifest) -> list[BlockRef]:
        known = {f.path for f in manifest.files}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ManifestError(f"fill order names files the manifest lacks: {unknown}")
        rank = {name: i for i, name in enumerate(names)}
        return sorted(manifest.block_refs(), key=lambda ref: rank.get(ref.path, len(rank)))

    return order


def layers_first(layers: Sequence[int], ranges: LayerRanges) -> BlockOrder:
    """Fetch the blocks overlapping each layer's byte spans, layer by layer in the order given."""

    def order(manifest: Manifest) -> list[BlockRef]:
        refs = list(manifest.block_refs())
        known = {f.path for f in manifest.files}
        chosen: list[BlockRef] = []
        taken: set[tuple[str, int]] = set()
        for layer in layers:
            for path, start, end in ranges.get(layer, ()):
                if path not in known:
                    raise ManifestError(f"layer {layer}'s tensors lie in {path!r}, which the manifest lacks")
                for ref in refs:
                    key = (ref.path, ref.index)
                    if ref.path == path and ref.offset < end and start < ref.offset + ref.length and key not in taken:
                        taken.add(key)
                        chosen.append(ref)
        return chosen

    return order


def heat_block_order(heat: Mapping[int, float] | None, num_layers: int, ranges: LayerRanges) -> BlockOrder:
    """The heat map's order (``warmpool.heatmap.layer_order``: hottest layer first) as a block order."""
    return layers_first(layer_order(heat, num_layers), ranges)
