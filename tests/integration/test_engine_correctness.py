"""The built-in engine's logits equal transformers' on the same weights (within dtype tolerance).

transformers is a test dependency only: this file imports it, the worker never does.
Tiny random models cover the variants (tied/untied head, Llama o/qkv biases, Qwen2 q/k/v
biases, multi-head vs grouped-query, llama3 and linear rope scaling, sharded files); the
real SmolLM2-135M-Instruct from `warmpool model fetch` covers a real tokenizer and weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import LlamaEngine, load_engine

pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")

TINY_CASES: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-tied": {"tie": True},
    "llama-bias": {"qkv_bias": True},
    "llama-mha-tied-bias": {"tie": True, "qkv_bias": True, "kv_heads": 4},
    "qwen2": {"model_type": "qwen2"},
    "qwen2-tied-sharded": {"model_type": "qwen2", "tie": True, "shards": 3},
    "llama3-rope": {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "rope_theta": 500000.0,
        "max_position_embeddings": 512,
    },
    "linear-rope": {"rope_scaling": {"type": "linear", "factor": 2.0}},
}
#: max |ours - theirs| allowed, relative to max |theirs|
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PROMPT = "The quick brown fox jumps over the lazy dog; then, quite unexpectedly, it sat down to write Python."


def _hf(model_dir: Path, dtype: torch.dtype) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def _compare(engine: LlamaEngine, model_dir: Path, dtype: torch.dtype, ids: list[int]) -> float:
    hf = _hf(model_dir, dtype)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    ours = engine.forward_logits(ids).float()
    assert ours.shape == theirs.shape
    diff = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    assert diff <= TOLERANCE[dtype] * scale, f"max logit diff {diff} vs scale {scale} in {dtype}"
    # and the ranking agrees wherever the top two are not within rounding of each other
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff + 1e-6
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    return diff


@pytest.mark.parametrize("case", sorted(TINY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_models_match_transformers(tmp_path: Path, case: str, dtype: torch.dtype) -> None:
    model_dir = make_tiny_llama(tmp_path / case, layers=3, seed=11, dtype="float32", **TINY_CASES[case])
    engine = load_engine(model_dir, dtype="float32" if dtype == torch.float32 else "bfloat16")
    ids = engine.encode(PROMPT)
    assert len(ids) > 64  # long enough that llama3 scaling's low-frequency band matters
    _compare(engine, model_dir, dtype, ids)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip("gguf")
    from warmpool_dev.model_fetch import ensure_model

    return ensure_model()


CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_logits_match_transformers(smollm2: Path, dtype: torch.dtype) -> None:
    engine = load_engine(smollm2, dtype="float32" if dtype == torch.float32 else "bfloat16")
    ids = engine.encode(CHAT)
    _compare(engine, smollm2, dtype, ids)


def test_smollm2_tokenizer_matches_transformers(smollm2: Path) -> None:
    engine = load_engine(smollm2)
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    assert engine.encode(CHAT) == theirs(CHAT)["input_ids"]


def test_smollm2_greedy_generation_matches_transformers(smollm2: Path) -> None:
    engine = load_engine(smollm2, dtype="float32")
    ids = engine.encode(CHAT)
    ours = [step.token_id for step in engine.generate(ids, 12)]
    hf = _hf(smollm2, torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False)
    theirs = out[0, len(ids):].tolist()
    n = min(len(ours), len(theirs))  # both stop at EOS; ours includes the EOS token itself
    assert n > 0 and ours[:n] == theirs[:n]
