"""The engine's request lifecycle on tiny real checkpoints: KV memory that grows with the tokens
generated, non-finite logits refused (never sampled), a failed warm-prefix save that costs only
the persistence."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Generator
from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import KV_BLOCK_TOKENS, LlamaEngine, load_engine
from warmpool_worker.engine_api import NonFiniteLogitsError
from warmpool_worker.warmup import WarmupProgress, execute_plan, plan_warmup

from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit

LONG_CONTEXT = 4096


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("m") / "long", layers=2, seed=5, max_position_embeddings=LONG_CONTEXT
    )


def _no_eos(engine: LlamaEngine) -> LlamaEngine:
    """Generation that never stops early, so the number of steps is the test's to choose."""
    engine.eos_token_ids = frozenset()
    return engine


def _capacity_bound(positions: int) -> int:
    """Largest capacity the growth rule may hold for this many positions (a quarter + a block)."""
    return math.floor(1.25 * positions) + KV_BLOCK_TOKENS


def test_kv_cache_grows_with_generated_tokens_not_max_tokens(long_model: Path) -> None:
    engine = _no_eos(load_engine(long_model))
    prompt = engine.encode("a short prompt")
    max_tokens = LONG_CONTEXT - len(prompt)
    assert engine.kv_cache_tokens() == 0
    steps = engine.generate(prompt, max_new_tokens=max_tokens)
    assert isinstance(steps, Generator)  # closed below, as the server closes it
    seen: list[int] = []
    for generated, _step in enumerate(steps, start=1):
        capacity = engine.kv_cache_tokens()
        positions = len(prompt) + generated  # K/V written so far (the last token's comes next step)
        assert positions - 1 <= capacity <= _capacity_bound(positions), (generated, capacity)
        seen.append(capacity)
        if generated == 150:  # past two growths (64 -> 128 -> 192 positions)
            break
    steps.close()
    assert seen[0] < 2 * KV_BLOCK_TOKENS < max_tokens  # not sized for max_tokens up front
    assert seen[-1] > seen[0]  # it grew as tokens came
    assert max(seen) < max_tokens // 4
    assert engine.kv_cache_tokens() == 0  # released with the generation


def test_growing_cache_decodes_like_a_full_recompute(long_model: Path) -> None:
    """Greedy tokens across several growths equal re-running the whole sequence each step."""
    engine = _no_eos(load_engine(long_model))
    prompt = list(range(10, 10 + KV_BLOCK_TOKENS - 4))  # the first growth comes within 4 steps
    count = KV_BLOCK_TOKENS + 12  # grows at 64 and again at 128 positions
    got = [step.token_id for step in engine.generate(prompt, max_new_tokens=count)]
    seq = list(prompt)
    expected: list[int] = []
    for _ in range(count):
        token = int(engine.forward_logits(seq)[-1].argmax())
        expected.append(token)
        seq.append(token)
    assert got == expected


def test_batched_decode_grows_its_cache_too(long_model: Path) -> None:
    engine = _no_eos(load_engine(long_model))
    prompts = [engine.encode("first prompt"), engine.encode("a second, longer prompt here")]
    count = KV_BLOCK_TOKENS - 4  # the longer prompt's row grows past 64 positions
    batch = engine.generate_batch(prompts, max_new_tokens=count)
    singles = [[step.token_id for step in engine.generate(p, max_new_tokens=count)] for p in prompts]
    assert batch == singles
    assert engine.kv_cache_tokens() == 0


@pytest.fixture(scope="module", params=["nan", "inf"])
def poisoned_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    value = float(request.param)
    return make_tiny_llama(
        tmp_path_factory.mktemp("m") / f"poisoned-{request.param}", layers=4, seed=3, poison_layers=(2,),
        poison_value=value,
    )


def test_non_finite_logits_are_refused_naming_model_and_weight(poisoned_model: Path) -> None:
    engine = load_engine(poisoned_model)
    prompt = engine.encode("hello")
    with pytest.raises(NonFiniteLogitsError) as prefill_error:
        engine.prefill(prompt)
    message = str(prefill_error.value)
    assert repr(poisoned_model.name) in message and "model.layers.2.mlp.down_proj.weight" in message
    steps = engine.generate(prompt, max_new_tokens=4)
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        next(steps)  # raised before any token is sampled from the garbage
    with pytest.raises(NonFiniteLogitsError):
        engine.generate_batch([prompt], max_new_tokens=2)
    assert engine.kv_cache_tokens() == 0


def test_warm_up_fails_on_a_poisoned_checkpoint(poisoned_model: Path) -> None:
    engine = load_engine(poisoned_model)
    plan = plan_warmup(Tier.FULL, layer_order=range(engine.num_layers), buckets=(16,), prompts_per_bucket=1,
                       decode_tokens=2, max_context=engine.max_context)
    progress = WarmupProgress()
    with pytest.raises(NonFiniteLogitsError, match=repr(poisoned_model.name)):
        execute_plan(engine, plan, ["warm me up"], progress)
    assert progress.prefills == {}


def test_failed_prefix_save_is_counted_not_fatal(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "m", layers=2, seed=1)
    engine = load_engine(model)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the KV directory should be\n")
    failures: list[OSError] = []
    plan = plan_warmup(Tier.FULL, layer_order=range(engine.num_layers), buckets=(8, 16), prompts_per_bucket=1,
                       decode_tokens=2, max_context=engine.max_context)
    progress = execute_plan(engine, plan, ["warm me up"], WarmupProgress(), kv_dir=blocker / "kv",
                            on_kv_save_error=failures.append)
    assert progress.prefills == {8: 1, 16: 1}  # the warm-up itself went on
    assert (progress.kv_saved, progress.kv_save_errors) == (0, 2)
    assert [f.errno for f in failures] == [errno.ENOTDIR, errno.ENOTDIR]


def test_prefix_save_disk_full_is_an_os_error_with_errno(tmp_path: Path) -> None:
    """What warm-up catches: a plain OSError carrying ENOSPC, nothing half-written left behind.

    The disk is /dev/full (every write answers ENOSPC): the engine's temporary file name is a
    link to it, so the engine's own write meets a real full device.
    """
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    model = make_tiny_llama(tmp_path / "m", layers=2, seed=1)
    engine = load_engine(model)
    target = tmp_path / "kv" / "prefix.safetensors"
    target.parent.mkdir()
    target.with_name(f".{target.name}.{os.getpid()}.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as failure:
        engine.save_prefix_kv(engine.encode("abc"), target)
    assert failure.value.errno == errno.ENOSPC
    assert not target.exists() and list(target.parent.iterdir()) == []
