"""Each bad input the loader can meet is a test: a clear ModelLoadError naming the file and problem."""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.checkpoint import open_checkpoint, read_safetensors_header
from warmpool_worker.engine_api import ModelLoadError, RequestError

pytestmark = pytest.mark.unit


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return make_tiny_llama(tmp_path / "tiny", layers=2)


def _read_raw(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_raw(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _rewrite_tensors(path: Path, change: Any) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_model_dir_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nowhere.*does not exist"):
        open_checkpoint(tmp_path / "nowhere")


def test_model_path_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        open_checkpoint(target)


def test_no_safetensors(model: Path) -> None:
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        open_checkpoint(model)


def test_stray_shard_without_index(model: Path) -> None:
    (model / "model.safetensors").rename(model / "weights.safetensors")
    with pytest.raises(ModelLoadError, match=r"weights\.safetensors.*neither"):
        open_checkpoint(model)


class _Tripwire:
    """Unpickling this creates a marker file: proof that pickle was (or was not) run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickle_only_is_refused_and_never_unpickled(model: Path, tmp_path: Path) -> None:
    (model / "model.safetensors").unlink()
    marker = tmp_path / "pickle-ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*refusing to load pickle"):
        load_engine(model)
    assert not marker.exists()


def test_truncated_file(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated file"):
        open_checkpoint(model)


def test_file_shorter_than_header_length_field(model: Path) -> None:
    (model / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ModelLoadError, match="too short"):
        open_checkpoint(model)


def test_header_length_beyond_file(model: Path) -> None:
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 10) + data[8:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: header length \d+ is beyond the end"):
        open_checkpoint(model)


def test_header_not_json(model: Path) -> None:
    path = model / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    with pytest.raises(ModelLoadError, match="malformed safetensors header JSON"):
        open_checkpoint(model)


def test_overlapping_offsets(model: Path) -> None:
    path = model / "model.safetensors"
    header, body = _read_raw(path)
    a = header["model.layers.0.input_layernorm.weight"]
    b = header["model.layers.0.post_attention_layernorm.weight"]
    b["data_offsets"] = list(a["data_offsets"])  # two tensors aliasing the same bytes
    _write_raw(path, header, body)
    with pytest.raises(ModelLoadError, match="overlap"):
        open_checkpoint(model)


def test_lying_offsets_past_the_data(model: Path) -> None:
    path = model / "model.safetensors"
    header, body = _read_raw(path)
    entry = header["model.norm.weight"]
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = [begin + len(body), end + len(body)]
    _write_raw(path, header, body)
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' ends at data byte"):
        open_checkpoint(model)


def test_offsets_that_disagree_with_dtype_and_shape(model: Path) -> None:
    path = model / "model.safetensors"
    header, body = _read_raw(path)
    header["model.norm.weight"]["shape"] = [32]  # half the bytes its offsets span
    _write_raw(path, header, body)
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight': dtype F32 shape \[32\] needs 128 bytes"):
        open_checkpoint(model)


def test_gap_in_data(model: Path) -> None:
    path = model / "model.safetensors"
    header, body = _read_raw(path)
    for entry in header.values():
        if isinstance(entry, dict) and "data_offsets" in entry:
            entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]
    _write_raw(path, header, b"\0" * 4 + body)
    with pytest.raises(ModelLoadError, match="gap in the data section"):
        open_checkpoint(model)


@pytest.mark.parametrize("bad_name", ["../../etc/passwd", "/abs/tensor", "model/../../x"])
def test_tensor_name_with_path_traversal(model: Path, bad_name: str) -> None:
    path = model / "model.safetensors"
    header, body = _read_raw(path)
    header[bad_name] = header.pop("model.norm.weight")
    _write_raw(path, header, body)
    with pytest.raises(ModelLoadError, match="is not allowed"):
        read_safetensors_header(path)


def test_index_with_dotdot_shard(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "sharded", shards=2)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"index\.json: shard name '\.\./outside\.safetensors' must be a plain"):
        open_checkpoint(model)


def test_index_pointing_at_missing_shard(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "sharded", shards=2)
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"points at shard 'model-00002-of-00002\.safetensors', which is missing"
    ):
        open_checkpoint(model)


def test_index_disagrees_with_shard(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "sharded", shards=2)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"listed in model\.safetensors\.index\.json is not in the shard"):
        open_checkpoint(model)


def test_missing_tensor(model: Path) -> None:
    _rewrite_tensors(model / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors needed by config\.json: model\.layers\.1\.mlp\.down"):
        open_checkpoint(model)


def test_extra_tensor(model: Path) -> None:
    _rewrite_tensors(model / "model.safetensors", lambda t: t.update({"model.layers.7.surprise": torch.zeros(3)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensors .*model\.layers\.7\.surprise"):
        open_checkpoint(model)


def test_shape_mismatch(model: Path) -> None:
    _rewrite_tensors(model / "model.safetensors",
                     lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)}))
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight' has shape \[64, 63\], config.json needs \[64, 64\]"):
        open_checkpoint(model)


def test_integer_weights_refused(model: Path) -> None:
    _rewrite_tensors(model / "model.safetensors",
                     lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(ModelLoadError, match="dtype I32; weights must be"):
        open_checkpoint(model)


def test_malformed_config_json(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON"):
        open_checkpoint(model)


def test_malformed_index_json(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "sharded", shards=2)
    (model / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json: malformed JSON"):
        open_checkpoint(model)


def test_config_missing(model: Path) -> None:
    (model / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file is missing"):
        open_checkpoint(model)


def test_unsupported_architecture(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        open_checkpoint(model)


def test_bad_config_value(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = -1
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'num_hidden_layers' must be a positive integer"):
        open_checkpoint(model)


def test_tokenizer_missing(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file is missing"):
        load_engine(model)


def test_tokenizer_malformed(model: Path) -> None:
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: cannot parse tokenizer"):
        load_engine(model)


def test_unknown_dtype(model: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype 'int4' is not supported"):
        load_engine(model, dtype="int4")


def test_out_of_range_prompt_length(model: Path) -> None:
    engine = load_engine(model)
    with pytest.raises(RequestError, match="longer than the context of 256"):
        engine.prefill([5] * 257)
    with pytest.raises(RequestError, match="empty"):
        list(engine.generate([], 4))
    with pytest.raises(RequestError, match="no room left"):
        engine.generate([5] * 256, 4)
    with pytest.raises(RequestError, match="out of the vocabulary"):
        engine.prefill([5, 10_000])


def test_stale_prefix_kv_file(tmp_path: Path) -> None:
    first = load_engine(make_tiny_llama(tmp_path / "a", seed=1))
    other = load_engine(make_tiny_llama(tmp_path / "b", seed=2))  # same shapes, other weights
    prefix = first.encode("system prompt")
    kv = tmp_path / "prefix.safetensors"
    first.save_prefix_kv(prefix, kv)
    assert first.model_digest != other.model_digest
    assert other.load_prefix_kv(prefix, kv) is False  # another model: stale
    assert first.load_prefix_kv([*prefix, 7], kv) is False  # another prompt: mismatched
    assert first.load_prefix_kv(prefix, tmp_path / "absent.safetensors") is False
    assert first.load_prefix_kv(prefix, kv) is True


def test_stale_prefix_kv_format_version(tmp_path: Path) -> None:
    engine = load_engine(make_tiny_llama(tmp_path / "a"))
    prefix = engine.encode("hello")
    kv = tmp_path / "prefix.safetensors"
    engine.save_prefix_kv(prefix, kv)
    header, body = _read_raw(kv)
    header["__metadata__"]["format_version"] = "0"
    _write_raw(kv, header, body)
    assert engine.load_prefix_kv(prefix, kv) is False


def test_corrupt_prefix_kv_file(tmp_path: Path) -> None:
    engine = load_engine(make_tiny_llama(tmp_path / "a"))
    prefix = engine.encode("hello")
    kv = tmp_path / "prefix.safetensors"
    engine.save_prefix_kv(prefix, kv)
    kv.write_bytes(kv.read_bytes()[:-64])
    with pytest.raises(ModelLoadError, match=r"prefix\.safetensors: truncated file"):
        engine.load_prefix_kv(prefix, kv)


# ---- bounded config: absurd sizes are refused before anything is sized from them ----------

_BOUNDED_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@pytest.mark.parametrize("key", _BOUNDED_KEYS)
def test_absurd_config_size_is_refused_naming_key_and_bound(model: Path, key: str) -> None:
    from warmpool_worker.checkpoint import CONFIG_BOUNDS

    config = json.loads((model / "config.json").read_text())
    config[key] = 10**8
    (model / "config.json").write_text(json.dumps(config))
    bound = CONFIG_BOUNDS[key]
    with pytest.raises(ModelLoadError, match=rf"config\.json: '{key}' is 100000000, above the bound of {bound}"):
        open_checkpoint(model)


def test_head_dim_derived_from_hidden_size_is_bounded(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=65_536, num_attention_heads=1, num_key_value_heads=1)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'head_dim' \(hidden_size 65536 / num_attention_heads 1\) "
                       r"is 65536, above the bound of 4096"):
        open_checkpoint(model)


def test_config_needing_more_bytes_than_the_files_hold_is_refused(model: Path) -> None:
    # Every size within its bound, the product far beyond the ~200 KB the tiny files hold:
    # refused from arithmetic, before the expected-tensor table or any tensor is built.
    config = json.loads((model / "config.json").read_text())
    config.update(num_hidden_layers=1000, hidden_size=8192, intermediate_size=28_672,
                  num_attention_heads=64, num_key_value_heads=8)
    (model / "config.json").write_text(json.dumps(config))
    held = (model / "model.safetensors").stat().st_size
    with pytest.raises(ModelLoadError, match=r"config\.json: the config needs \d+ weight elements .* "
                       r"files hold only \d+ bytes of data") as raised:
        open_checkpoint(model)
    needed_bytes = int(str(raised.value).split("at least ")[1].split(" ")[0])
    assert needed_bytes > 1000 * held


def test_expected_parameters_agrees_with_the_tensor_table(tmp_path: Path) -> None:
    # The arithmetic count that gates a config is the sum of the shapes the loader then checks.
    import math

    from warmpool_worker.checkpoint import expected_parameters, expected_tensors

    for options in ({}, {"tie": True}, {"qkv_bias": True}, {"model_type": "qwen2"}):
        path = make_tiny_llama(tmp_path / f"m{len(list(tmp_path.iterdir()))}", **options)
        config = open_checkpoint(path).config
        assert expected_parameters(config) == sum(math.prod(s) for s in expected_tensors(config).values())


def test_a_tensor_the_weight_table_needs_but_the_checkpoint_lacks_fails_the_load(model: Path) -> None:
    """Loading never skips a tensor: one the weight table names and the files lack is an error naming it.

    The checkpoint validated for a bias-free config is handed to the engine under a config whose
    table names q/k/v biases: loading without them would silently compute a different model.
    """
    from tokenizers import Tokenizer
    from warmpool_worker.builtin.engine import LlamaEngine
    from warmpool_worker.checkpoint import CONFIG_FILE, TOKENIZER_FILE, Checkpoint

    validated = open_checkpoint(model)
    assert not validated.config.attention_bias
    needs_bias = dataclasses.replace(validated.config, attention_bias=True)
    checkpoint = Checkpoint(model, needs_bias, validated.headers, (model / CONFIG_FILE).read_bytes())
    engine = LlamaEngine(checkpoint, Tokenizer.from_file(str(model / TOKENIZER_FILE)))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        engine.load_layers([0])
    assert engine.layers_resident() == 0
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias"):
        engine.prefill([5, 6, 7])
