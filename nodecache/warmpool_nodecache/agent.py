"""The node agent's decisions and its cache-side work, without the API server (standard library only).

``agent_kube.py`` watches the cluster and calls into this module: which WarmModels have an
object-store source (:func:`model_ref`), the source object for one (:func:`open_source`), the
order to fill in -- the first block of every safetensors file (its header says where each
layer's tensors lie), then the heat map's layers hottest first (:func:`heat_order`) -- how much
of a revision the cache holds (:func:`cached_bytes`), and which node labels to set or drop
(:func:`label_changes`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmpool import cachekeys
from warmpool.contract.files import DIGEST_SAMPLE_BYTES, OUTPUT_HEAD_TENSOR
from warmpool.contract.nodecache import CACHE_NODE_LABEL_PREFIX, CACHE_NODE_LABEL_VALUE
from warmpool.contract.pods import ANNOTATION_CACHE_REVISION
from warmpool.heatmap import HeatMap, HeatMapError
from warmpool.lease import LeaseLostError
from warmpool_nodecache.blocks import BlockCorruptError, BlockStore
from warmpool_nodecache.journal import journaled
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import BlockRef, Manifest, ManifestError
from warmpool_nodecache.netguard import AddressPolicy
from warmpool_nodecache.order import BlockOrder, LayerRanges, heat_block_order, layers_first
from warmpool_nodecache.source import ReadLimits, Source, SourceError
from warmpool_nodecache.spec import DEFAULT_POLICY, credentials_from_secret_data, source_from_spec
from warmpool_nodecache.trust import DomainBlocks

#: A decoder layer's tensor names ("model.layers.7.mlp..."): the same families the worker's
#: prefetch knows (warmpool_worker.prefetch, which the agent's image does not ship).  The index is
#: ASCII digits, at most five (the operator's bound on layers): names come from a tenant's file,
#: and "layers.99999999999." made the layer order a list of a hundred billion layers.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.([0-9]{1,5})\.", re.ASCII)
#: A safetensors header larger than this is refused (the format's own readers cap it alike).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class ModelRef:
    """One WarmModel with an object-store source, as the agent needs it."""

    namespace: str
    name: str
    uid: str
    source: dict[str, Any]  # {"http": {...}} or {"s3": {...}}, camelCase as in the API
    fingerprint: str
    secret_name: str | None  # s3: the Secret with the keys
    #: spec.model.startOnPartialCache: fill as a partial view; the namespace's partial/<hex> names the revision
    partial: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def domain(self) -> str:
        """The node cache's trust domain of its fills (``trust.py``): its namespace, as the operator's
        pods name it in their mount (``domains/<namespace>/...``)."""
        return self.namespace


#: A pod in one of these phases has no containers left: it mounts nothing.
_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
_REVISION_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")


def mounted_revisions(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Digests (hex) of the revisions the pods mount, from the annotation the operator puts on
    every object-store pod: a finished pod or a value that is not a digest counts for nothing."""
    found: set[str] = set()
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in _FINISHED_PHASES:
            continue
        value = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_CACHE_REVISION)
        match = _REVISION_DIGEST_RE.fullmatch(value) if isinstance(value, str) else None
        if match:
            found.add(match.group(1))
    return found


def model_ref(obj: Mapping[str, Any]) -> ModelRef | None:
    """The WarmModel as a ModelRef when its source is http or s3; None otherwise."""
    meta = obj.get("metadata") or {}
    model = (obj.get("spec") or {}).get("model") or {}
    for kind in ("http", "s3"):
        block = model.get(kind)
        if isinstance(block, Mapping):
            source = {kind: dict(block)}
            secret = (block.get("secretRef") or {}).get("name") if kind == "s3" else None
            return ModelRef(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")), source,
                            cachekeys.source_fingerprint(source), secret,
                            partial=model.get("startOnPartialCache") is True)
    return None


def open_source(source: Mapping[str, Any], secret_data: Mapping[str, str] | None, secret: str = "the Secret",
                policy: AddressPolicy = DEFAULT_POLICY, limits: ReadLimits | None = None,
                ca_bundle: str | None = None, default_chain: bool = False) -> Source:
    """The Source object for a WarmModel's http/s3 block (``secret_data``: the s3 Secret's ``.data``,
    base64 values as the API returns them; None for http or an s3 source without a secretRef),
    guarded by ``policy`` and bounded by ``limits``; ``ca_bundle``: the PEM text its caBundle names;
    ``default_chain``: an s3 source without a secretRef signs with the agent's own credentials."""
    profile = (source.get("s3") or {}).get("profile")
    profile = profile if isinstance(profile, str) else None
    credentials = None if secret_data is None else credentials_from_secret_data(secret_data, secret, profile)
    return source_from_spec(source, credentials=credentials, policy=policy, limits=limits, ca_bundle=ca_bundle,
                            default_chain=default_chain)


def safetensors_header(first_block: bytes, describe: str) -> dict[str, Any] | None:
    """The JSON header of a safetensors file from its first bytes; None when it runs past them."""
    if len(first_block) < 8:
        return None
    (length,) = struct.unpack("<Q", first_block[:8])
    # Neither the length nor the JSON parser's complaint goes into the message: both are read
    # from fetched bytes, and a failed fill's message reaches the WarmModel's status.
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"{describe}: the safetensors header length is implausible (over {MAX_HEADER_BYTES} bytes)")
    if 8 + length > len(first_block):
        return None
    try:
        header = json.loads(first_block[8:8 + length])
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{describe}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{describe}: safetensors header is not a JSON object")
    header["__data_start__"] = 8 + length
    return header


def layer_ranges(headers: Mapping[str, Mapping[str, Any]]) -> tuple[int, LayerRanges]:
    """(number of layers, layer -> byte spans) from each file's safetensors header."""
    spans: dict[int, list[tuple[str, int, int]]] = {}
    for path, header in headers.items():
        start = int(header["__data_start__"])
        for name, info in header.items():
            if name.startswith("__") or not isinstance(info, Mapping):
                continue
            match = _LAYER_RE.search(name)
            offsets = info.get("data_offsets")
            if match is None or not isinstance(offsets, list) or len(offsets) != 2:
                continue
            spans.setdefault(int(match.group(1)), []).append((path, start + int(offsets[0]), start + int(offsets[1])))
    return (max(spans) + 1 if spans else 0), spans


def header_blocks(manifest: Manifest) -> list[BlockRef]:
    """The first block of every safetensors file (fetched first: the headers order the rest)."""
    return [ref for ref in manifest.block_refs() if ref.index == 0 and ref.path.endswith(".safetensors")]


def heat_order(manifest: Manifest, headers: Mapping[str, Mapping[str, Any]], heat_text: str | None) -> BlockOrder:
    """Header blocks, then the layers hottest first (the default order without a usable heat map)."""
    num_layers, ranges = layer_ranges(headers)
    heat: dict[int, float] | None = None
    if heat_text:
        try:
            parsed = HeatMap.from_json(json.loads(heat_text), "the WarmModel's heat map")
            heat = parsed.heat if parsed.num_layers == num_layers else None
        except (ValueError, HeatMapError):
            heat = None  # advisory: a bad map only costs the order
    by_heat = heat_block_order(heat, num_layers, ranges)
    first = header_blocks(manifest)

    def order(m: Manifest) -> list[BlockRef]:
        return first + [ref for ref in by_heat(m) if ref.index != 0 or not ref.path.endswith(".safetensors")]

    return order


def core_spans(headers: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, int, int]]:
    """Byte spans of the tensors outside the decoder layers that the engine loads before any layer
    (embeddings, final norm): an untied output head comes after the layers, with the rest."""
    spans: list[tuple[str, int, int]] = []
    for path, header in headers.items():
        start = int(header["__data_start__"])
        for name, info in header.items():
            offsets = info.get("data_offsets") if isinstance(info, Mapping) else None
            if name.startswith("__") or _LAYER_RE.search(name) or name == OUTPUT_HEAD_TENSOR \
                    or not isinstance(offsets, list) or len(offsets) != 2:
                continue
            spans.append((path, start + int(offsets[0]), start + int(offsets[1])))
    return spans


def start_order(manifest: Manifest, headers: Mapping[str, Mapping[str, Any]], heat_text: str | None) -> BlockOrder:
    """What a worker started on a partial view needs, in the order it needs it: the files that are
    not weights (config, tokenizer, index: read whole at start), the header blocks, the core tensors
    the engine loads before any layer (:func:`core_spans`), then the layers hottest first
    (:func:`heat_order`); the rest (an untied output head) follows in file order."""
    by_heat = heat_order(manifest, headers, heat_text)
    # what opening the checkpoint reads (the digest's sample of the data), then the core tensors
    opening = [(path, 0, int(header["__data_start__"]) + DIGEST_SAMPLE_BYTES) for path, header in headers.items()]
    core = layers_first([0, 1], {0: opening, 1: core_spans(headers)})

    def order(m: Manifest) -> list[BlockRef]:
        small = [ref for ref in m.block_refs() if not ref.path.endswith(".safetensors")]
        first = header_blocks(m)
        chosen: list[BlockRef] = []
        seen: set[tuple[str, int]] = set()
        for ref in [*small, *first, *core(m), *by_heat(m)]:
            if (ref.path, ref.index) not in seen:
                seen.add((ref.path, ref.index))
                chosen.append(ref)
        return chosen

    return order


def cached_bytes(layout: CacheLayout, manifest: Manifest, domain: str) -> int:
    """Bytes of the revision's (distinct) blocks present in the cache for ``domain``: those it verified
    itself (another domain's blocks are not its to count: the figure would say which hashes they hold),
    held by the store or already durable in a fill's view of the revision (its journal)."""
    blocks = DomainBlocks(BlockStore(layout), domain)
    filling = journaled(layout, manifest.digest_hex)
    seen: set[str] = set()
    total = 0
    for ref in manifest.block_refs():
        if ref.sha256 not in seen:
            seen.add(ref.sha256)
            if (ref.sha256 in filling and blocks.vouched(ref.sha256)) or blocks.usable(ref.sha256):
                total += ref.length
    return total


def revision_path(layout: CacheLayout, digest_hex: str, domain: str) -> str | None:
    """The real path (symbolic links resolved, on this node) of the revision's directory the
    domain's pods use: the published revision it was granted, else the partial view its link points
    at, else where the revision will be published.  Reported from the first read on, before any pod is built, so
    the operator checks this path -- not the one it writes -- against the directories it may
    mount: a link in the cache's path cannot lead a mount out of them unseen."""
    for candidate in (layout.granted_link(digest_hex, domain), layout.partial_link(digest_hex, domain)):
        if candidate.is_dir():
            real = os.path.realpath(candidate)
            break
    else:
        real = os.path.join(os.path.realpath(layout.revisions), digest_hex)
    return real if len(real) <= 4096 else None  # the status field's bound


def failure_text(error: BaseException) -> str:
    """What a failure says in a status entry or Event: the error's own words for the errors that
    name what is wrong, with the type for any other (it is a bug there, and the type says where)."""
    if isinstance(error, (SourceError, ManifestError, BlockCorruptError, LeaseLostError)):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    return text[:1000]


def unique_bytes(manifest: Manifest) -> int:
    seen: set[str] = set()
    total = 0
    for ref in manifest.block_refs():
        if ref.sha256 not in seen:
            seen.add(ref.sha256)
            total += ref.length
    return total


def published_digests(layout: CacheLayout) -> set[str]:
    if not layout.revisions.is_dir():
        return set()
    return {f"sha256:{p.name}" for p in layout.revisions.iterdir() if p.is_dir() and len(p.name) == 64}


def label_changes(labels: Mapping[str, str], published: set[str]) -> dict[str, str | None]:
    """The node-label patch (None drops a label) that makes the cache labels match ``published``."""
    want = {cachekeys.cache_node_label(d): CACHE_NODE_LABEL_VALUE for d in published}
    prefix = CACHE_NODE_LABEL_PREFIX + "/"
    patch: dict[str, str | None] = {k: None for k in labels if k.startswith(prefix) and k not in want}
    patch.update({k: v for k, v in want.items() if labels.get(k) != v})
    return patch
