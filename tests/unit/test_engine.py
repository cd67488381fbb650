"""The built-in engine on tiny random models: lazy loading, load order, heat, generation, prefix KV."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import LlamaEngine, bucket_for, load_engine, token_hash
from warmpool_worker.engine_api import RequestError

from warmpool.heatmap import layer_order

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=4, seed=3)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record_loads(engine: LlamaEngine) -> list[str]:
    """Spy on the checkpoint: the names of tensors read, in order."""
    seen: list[str] = []
    original = engine.checkpoint.get_tensor

    def spy(name: str) -> torch.Tensor:
        seen.append(name)
        return original(name)

    engine.checkpoint.get_tensor = spy  # type: ignore[method-assign]
    return seen


def _reference_greedy(engine: LlamaEngine, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step: no KV cache to get wrong."""
    out: list[int] = []
    seq = list(ids)
    for _ in range(n):
        token = int(engine.forward_logits(seq)[-1].argmax())
        out.append(token)
        seq.append(token)
    return out


def test_load_engine_maps_without_loading(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    # "Maps without loading" checked exactly, not by a wall-clock bound: no weight byte was read.
    assert engine.bytes_loaded == 0
    assert engine.layers_resident() == 0
    assert engine.num_layers == 4
    assert engine.max_context == 256
    assert engine.device == "cpu"
    assert engine.model_name == "tiny"
    assert len(engine.model_digest) == 64


def test_model_name_override(model_dir: Path) -> None:
    assert load_engine(model_dir, model_name="served-as").model_name == "served-as"


def test_layer_loaded_on_first_use(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    engine.prefill(engine.encode("hi"))
    assert engine.layers_resident() == 4


def test_load_order_embeddings_then_given_order_then_untied_head(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    seen = _record_loads(engine)
    progress: list[tuple[int, int, int]] = []
    head_read_at_progress: list[bool] = []

    def on_layer(resident: int, total: int, index: int) -> None:
        progress.append((resident, total, index))
        head_read_at_progress.append("lm_head.weight" in seen)

    engine.load_layers([2, 0], on_layer)
    assert progress == [(1, 4, 2), (2, 4, 0)]
    assert seen[:2] == ["model.embed_tokens.weight", "model.norm.weight"]
    layers_in_order = [int(n.split(".")[2]) for n in seen[2:]]
    assert layers_in_order == sorted(layers_in_order, key=[2, 0].index)
    assert engine.is_layer_resident(2) and engine.is_layer_resident(0) and not engine.is_layer_resident(1)
    assert "lm_head.weight" not in seen  # layers are left to load: the head waits for them (or a first use)
    engine.load_layers([2, 0])  # idempotent: nothing read again
    assert len(seen) == 2 + 2 * 9
    engine.load_layers([3, 1], on_layer)  # the last layers: the head comes after them
    assert head_read_at_progress == [False] * 4
    assert seen[-1] == "lm_head.weight" and len(seen) == 3 + 4 * 9
    engine.load_layers([])  # the core alone: already whole, nothing read
    assert len(seen) == 3 + 4 * 9


def test_an_empty_order_loads_embeddings_norm_and_head(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    seen = _record_loads(engine)
    engine.load_layers([])
    assert seen == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def test_a_request_before_the_load_reads_the_head_on_use(model_dir: Path) -> None:
    reference = load_engine(model_dir)
    ids = reference.encode("the quick brown fox")
    expected = [s.token_id for s in reference.generate(ids, 4)]
    engine = load_engine(model_dir)
    seen = _record_loads(engine)
    engine.load_layers([3, 1, 0, 2])
    assert [s.token_id for s in engine.generate(ids, 4)] == expected
    assert seen.count("lm_head.weight") == 1


def test_a_tied_head_is_the_embedding_and_never_read(tmp_path: Path) -> None:
    tied = make_tiny_llama(tmp_path / "tied", layers=2, seed=5, tie=True)
    reference = load_engine(tied)
    ids = reference.encode("tied heads")
    expected = [s.token_id for s in reference.generate(ids, 4)]  # loaded on use, all at once
    engine = load_engine(tied)
    seen = _record_loads(engine)
    engine.load_layers([1, 0])
    assert "lm_head.weight" not in seen and seen[0] == "model.embed_tokens.weight"
    assert [s.token_id for s in engine.generate(ids, 4)] == expected
    assert [name for name, _ in engine.weights.resident()].count("model.embed_tokens.weight") == 1
    assert len(seen) == 2 + 2 * 9  # nothing read again by the generation


def test_load_layers_rejects_bad_index(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="out of range"):
        load_engine(model_dir).load_layers([0, 4])


def test_request_during_background_load_sees_every_weight_once(model_dir: Path) -> None:
    reference = load_engine(model_dir)
    ids = reference.encode("the quick brown fox")
    expected = [s.token_id for s in reference.generate(ids, 6)]

    engine = load_engine(model_dir)
    seen = _record_loads(engine)
    original = engine.checkpoint.get_tensor

    def slow(name: str) -> torch.Tensor:
        time.sleep(0.01)  # make the loader and the request actually overlap
        return original(name)

    engine.checkpoint.get_tensor = slow  # type: ignore[method-assign]
    loader = threading.Thread(target=engine.load_layers, args=([3, 2, 1, 0],))
    loader.start()
    got = [s.token_id for s in engine.generate(ids, 6)]
    loader.join()
    assert got == expected
    assert engine.layers_resident() == 4
    counts = Counter(seen)
    assert counts and max(counts.values()) == 1  # no tensor loaded twice
    assert len(counts) == 3 + 4 * 9


def test_heat_decays_with_time(model_dir: Path) -> None:
    clock = _Clock()
    engine = load_engine(model_dir, heat_half_life_s=10.0, clock=clock)
    assert engine.layer_heat() == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    engine.prefill([5, 6, 7])
    assert engine.layer_heat()[0] == pytest.approx(1.0)
    clock.now += 10.0
    assert engine.layer_heat()[3] == pytest.approx(0.5)
    engine.prefill([5, 6])
    assert engine.layer_heat()[1] == pytest.approx(1.5)
    clock.now += 20.0
    assert engine.layer_heat()[2] == pytest.approx(0.375)


def test_order_from_heat() -> None:
    # the engine's own copy of heat ordering is gone: the one shared ordering decides
    assert layer_order({3: 5.0, 1: 9.0, 0: 5.0, 99: 1.0}, 5) == [1, 0, 3, 2, 4]


def test_greedy_generation_matches_full_recompute(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    ids = engine.encode("hello world")
    steps = list(engine.generate(ids, 8))
    assert [s.token_id for s in steps] == _reference_greedy(engine, ids, 8)
    assert [s.finished for s in steps] == [False] * 7 + [True]
    assert steps[-1].finish_reason == "length"
    assert "".join(s.text for s in steps) == engine.decode([s.token_id for s in steps])


def test_generation_stops_on_eos(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    ids = engine.encode("hello")
    first = next(iter(engine.generate(ids, 5))).token_id
    engine.eos_token_ids = frozenset({first})
    steps = list(engine.generate(ids, 5))
    assert len(steps) == 1
    assert steps[0].finished and steps[0].finish_reason == "stop" and steps[0].text == ""


def test_eos_ids_from_generation_config(model_dir: Path) -> None:
    assert load_engine(model_dir).eos_token_ids == frozenset({2})


def test_sampling_with_temperature(model_dir: Path) -> None:
    """Sampling (temperature > 0) draws from the engine's own randomly seeded generator: tokens of
    the vocabulary, and not the greedy path.  A draw may hit the end-of-sequence token early, so
    each run must end either at the length limit or on EOS with finish reason "stop"."""
    engine = load_engine(model_dir)
    greedy = [s.token_id for s in engine.generate([5, 6, 7], 12)]
    runs = [list(engine.generate([5, 6, 7], 12, temperature=1.5)) for _ in range(6)]
    for steps in runs:
        assert all(0 <= s.token_id < 272 for s in steps)
        last = steps[-1]
        assert last.finished
        if len(steps) < 12:
            assert last.finish_reason == "stop" and last.token_id in engine.eos_token_ids
        else:
            assert len(steps) == 12
    assert any([s.token_id for s in steps] != greedy for steps in runs)  # not greedy


def test_generation_rejects_bad_parameters(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate([5], 0)
    with pytest.raises(RequestError, match="temperature"):
        engine.generate([5], 3, temperature=-1.0)


def test_completion_clamped_to_context(tmp_path: Path) -> None:
    engine = load_engine(make_tiny_llama(tmp_path / "short", max_position_embeddings=16))
    steps = list(engine.generate([5] * 12, 100))
    assert len(steps) == 4 and steps[-1].finish_reason == "length"


def test_batched_decode_matches_single(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    prompts = [engine.encode("alpha beta"), engine.encode("g"), engine.encode("a longer third prompt")]
    batch = engine.generate_batch(prompts, 6)
    singles = [[s.token_id for s in engine.generate(p, 6)] for p in prompts]
    assert batch == singles
    assert bucket_for(3) == 4 and bucket_for(1) == 1 and bucket_for(5) == 8
    with pytest.raises(RequestError):
        bucket_for(9)


def test_prefix_kv_round_trip(tmp_path: Path, model_dir: Path) -> None:
    writer = load_engine(model_dir)
    prefix = writer.encode("You are a helpful assistant. ")
    path = tmp_path / "kv" / "prefix.safetensors"
    writer.save_prefix_kv(prefix, path)
    assert path.is_file() and not list(path.parent.glob(".*tmp"))

    prompt = prefix + writer.encode("Say hi")
    expected = [s.token_id for s in load_engine(model_dir).generate(prompt, 6)]

    reader = load_engine(model_dir)
    assert reader.load_prefix_kv(prefix, path) is True
    hit = reader.prefix_kv.lookup(prompt)
    assert hit is not None and hit.length == len(prefix)
    assert [s.token_id for s in reader.generate(prompt, 6)] == expected
    # the prompt equal to the prefix itself still runs its last token
    assert [s.token_id for s in reader.generate(prefix, 3)] == _reference_greedy(reader, prefix, 3)


def test_prefix_kv_metadata(tmp_path: Path, model_dir: Path) -> None:
    from warmpool_worker.checkpoint import read_safetensors_header

    engine = load_engine(model_dir)
    prefix = [5, 6, 7, 8]
    path = tmp_path / "p.safetensors"
    engine.save_prefix_kv(prefix, path)
    meta = read_safetensors_header(path).metadata
    assert meta["model_digest"] == engine.model_digest
    assert meta["token_hash"] == token_hash(prefix)
    assert meta["format_version"] == "1"


@pytest.mark.parametrize(("stored", "compute"), [("bfloat16", "bfloat16"), ("bfloat16", None), ("float16", "float32")])
def test_dtypes(tmp_path: Path, stored: str, compute: str | None) -> None:
    engine = load_engine(make_tiny_llama(tmp_path / stored, dtype=stored), dtype=compute)
    expected = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: torch.float32}[compute]
    assert engine.dtype == expected  # CPU default is fp32
    steps: list[Any] = list(engine.generate([5, 6, 7], 3))
    assert len(steps) == 3


def test_sharded_and_tied_models_load(tmp_path: Path) -> None:
    a = load_engine(make_tiny_llama(tmp_path / "one", seed=4, tie=True))
    b = load_engine(make_tiny_llama(tmp_path / "three", seed=4, tie=True, shards=3))
    ids = [5, 9, 11, 40]
    assert torch.equal(a.forward_logits(ids), b.forward_logits(ids))


def test_capture_graphs_is_a_noop_on_cpu(model_dir: Path) -> None:
    engine = load_engine(model_dir)
    assert engine.capture_graphs() == {}
    assert engine.graph_buckets == []


def test_worker_start_path_imports_no_transformers(model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path;"
        "from warmpool_worker.builtin.engine import load_engine;"
        f"e = load_engine(Path({str(model_dir)!r})); e.prefill([5, 6]);"
        "bad = [m for m in ('transformers', 'gguf', 'accelerate') if m in sys.modules];"
        "assert not bad, bad"
    )
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'worker'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_checkpoint_module_is_cheap_to_import() -> None:
    code = "import sys, warmpool_worker.checkpoint; assert 'torch' not in sys.modules"
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'worker'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("variant", [
    {}, {"tie": True}, {"qkv_bias": True}, {"model_type": "qwen2", "shards": 2},
], ids=["llama", "tied", "llama-bias", "qwen2-sharded"])
def test_the_weight_table_that_validates_is_the_one_that_loads(tmp_path: Path, variant: dict[str, Any]) -> None:
    """The engine reads exactly the tensors validation required: one table, both sides."""
    from warmpool_worker.checkpoint import expected_tensors

    engine = load_engine(make_tiny_llama(tmp_path / "m", layers=2, **variant))
    seen = _record_loads(engine)
    engine.load_all()
    required = expected_tensors(engine.config)
    assert sorted(seen) == sorted(required)
    assert {name: tuple(t.shape) for name, t in engine.weights.resident()} == required


def test_worker_engine_package_imports_no_transformers() -> None:
    code = ("import sys, warmpool_worker.builtin.engine;"
            "bad = [m for m in ('transformers', 'gguf', 'accelerate') if m in sys.modules]; assert not bad, bad")
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'worker'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
