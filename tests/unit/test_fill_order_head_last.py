"""The node agent's hot-first fill fetches an untied output head after the decoder layers, as the
built-in engine loads it: a worker started on a cache still filling reaches its first layer before
the head's bytes (as large as the embeddings') have come."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_nodecache import agent
from warmpool_nodecache.manifest import BlockRef, build_manifest

from tests.support.partial_worker import headers_of
from warmpool.contract.files import DIGEST_SAMPLE_BYTES, OUTPUT_HEAD_TENSOR

pytestmark = pytest.mark.unit

BLOCK = 16 * 1024


def _overlaps(ref: BlockRef, span: tuple[str, int, int]) -> bool:
    path, start, end = span
    return ref.path == path and ref.offset < end and start < ref.offset + ref.length


def _first_block_of(refs: list[BlockRef], span: tuple[str, int, int]) -> int:
    return min(i for i, r in enumerate(refs) if _overlaps(r, span))


def _last_block_of(refs: list[BlockRef], span: tuple[str, int, int]) -> int:
    return max(i for i, r in enumerate(refs) if _overlaps(r, span))


def _span(headers: dict[str, dict[str, object]], name: str) -> tuple[str, int, int]:
    header = headers["model.safetensors"]
    info = header[name]
    assert isinstance(info, dict)
    start = int(str(header["__data_start__"]))
    return "model.safetensors", start + info["data_offsets"][0], start + info["data_offsets"][1]


@pytest.mark.parametrize("tie", [False, True])
def test_the_start_order_fetches_embeddings_then_layers_then_an_untied_head(tmp_path: Path, tie: bool) -> None:
    model = make_tiny_llama(tmp_path / "m", layers=3, hidden=64, intermediate=128, vocab_size=2048, seed=2, tie=tie)
    manifest = build_manifest(model, BLOCK)
    headers = headers_of(model, BLOCK)
    refs = list(agent.start_order(manifest, headers, None)(manifest))
    refs += [r for r in manifest.block_refs() if (r.path, r.index) not in {(x.path, x.index) for x in refs}]
    _, layers = agent.layer_ranges(headers)
    last_layer_block = max(_last_block_of(refs, span) for spans in layers.values() for span in spans)
    first_layer_block = min(_first_block_of(refs, span) for span in layers[0])
    assert _last_block_of(refs, _span(headers, "model.embed_tokens.weight")) <= first_layer_block
    if tie:
        assert OUTPUT_HEAD_TENSOR not in headers["model.safetensors"]
    else:  # the head's blocks come after every layer's, but those opening the checkpoint reads (the
        # header, the digest's sample of the data) and those it shares with the embeddings
        data_start = int(str(headers["model.safetensors"]["__data_start__"]))
        opening = ("model.safetensors", 0, data_start + DIGEST_SAMPLE_BYTES)
        shared = {i for i, r in enumerate(refs) if _overlaps(r, opening)}
        shared |= {_first_block_of(refs, _span(headers, "model.embed_tokens.weight")),
                   _last_block_of(refs, _span(headers, "model.embed_tokens.weight"))}
        assert max(shared) <= first_layer_block
        head = [i for i, r in enumerate(refs) if _overlaps(r, _span(headers, OUTPUT_HEAD_TENSOR))]
        assert len(head) > len(shared)
        assert all(i > last_layer_block for i in head if i not in shared)
