"""CPU loads in the checkpoint's own dtype use the weights in place, in the file's mapping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import LlamaEngine, load_engine
from warmpool_worker.checkpoint import expected_tensors

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("zc") / "tiny", layers=2, seed=5)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """[start, end) of every mapping of this file in this process."""
    target = str(path.resolve())
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def _weights(engine: LlamaEngine) -> dict[str, torch.Tensor]:
    """Every weight the engine holds, by checkpoint name: all of them, once everything is loaded."""
    assert engine.layers_resident() == engine.num_layers
    out = dict(engine.weights.resident())
    assert set(out) == set(expected_tensors(engine.config))
    return out


def _inside(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(a <= start and end <= b for a, b in spans)


def test_same_dtype_cpu_load_shares_the_mapping(model_dir: Path) -> None:
    engine = load_engine(model_dir, device="cpu", dtype="float32")  # make_tiny_llama writes fp32
    engine.load_all()
    spans = _file_mappings(model_dir / "model.safetensors")
    assert spans, "the checkpoint is not mapped"
    weights = _weights(engine)
    assert all(t.dtype == torch.float32 for t in weights.values())
    outside = [name for name, t in weights.items() if not _inside(t, spans)]
    assert outside == [], f"copied out of the mapping: {outside}"
    # the weights are the file's bytes, and a forward pass leaves them untouched
    ids = engine.encode("zero copy")
    before = {name: t.clone() for name, t in weights.items()}
    engine.forward_logits(ids)
    assert all(torch.equal(before[name], t) for name, t in weights.items())


def test_other_dtype_cpu_load_converts_into_private_memory(model_dir: Path) -> None:
    engine = load_engine(model_dir, device="cpu", dtype="bfloat16")
    engine.load_all()
    spans = _file_mappings(model_dir / "model.safetensors")
    weights = _weights(engine)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not any(_inside(t, spans) for t in weights.values())
    reference = engine.checkpoint.get_tensor("model.layers.0.self_attn.q_proj.weight").to(torch.bfloat16)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], reference)
