"""Warm-up planning by tier, top-ups, prompt sizing, and execution on an honest fake engine."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from warmpool_worker.warmup import (
    DEFAULT_PROMPTS,
    PromptsError,
    WarmupProgress,
    WarmupStopped,
    execute_plan,
    fit_buckets,
    kv_prefix_path,
    load_prompts,
    parse_buckets,
    plan_warmup,
    sized_prompt_text,
    sized_prompt_tokens,
)

from tests.support.fake_engine import FakeEngine
from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit

ORDER = [5, 2, 9, 0, 1, 3, 4, 6, 7, 8]  # ten layers, hottest first


def test_full_plan() -> None:
    plan = plan_warmup(Tier.FULL, layer_order=ORDER)
    assert plan.buckets == (32, 128, 512)
    assert plan.resident_layers == tuple(ORDER)
    assert plan.prompts_per_bucket == 2
    assert plan.total_prefills == 6


def test_unknown_plans_like_full() -> None:
    full = plan_warmup(Tier.FULL, layer_order=ORDER)
    unknown = plan_warmup(Tier.UNKNOWN, layer_order=ORDER)
    assert (unknown.buckets, unknown.resident_layers) == (full.buckets, full.resident_layers)


def test_truncated_plan() -> None:
    plan = plan_warmup(Tier.TRUNCATED, layer_order=ORDER, hot_layer_percent=30)
    assert plan.buckets == (32,)
    assert plan.resident_layers == (5, 2, 9)
    assert plan.prompts_per_bucket == 1


def test_paused_plan_is_empty() -> None:
    plan = plan_warmup(Tier.PAUSED, layer_order=ORDER)
    assert plan.is_empty() and plan.total_prefills == 0


def test_buckets_fit_context() -> None:
    assert fit_buckets((32, 128, 512), 200, 4) == (32, 128, 196)
    assert fit_buckets((32, 512), 40, 8) == (32,)
    assert fit_buckets((32,), 4, 4) == ()
    plan = plan_warmup(Tier.FULL, layer_order=ORDER, max_context=100, decode_tokens=4)
    assert plan.buckets == (32, 96)


def test_top_up_only_adds_what_is_missing() -> None:
    progress = WarmupProgress(layers_forced={5, 2, 9}, prefills={32: 1})
    deeper = progress.remaining(plan_warmup(Tier.FULL, layer_order=ORDER))
    assert deeper.resident_layers == (0, 1, 3, 4, 6, 7, 8)
    assert deeper.buckets == (32, 128, 512)  # bucket 32 had 1 of 2
    progress.prefills[32] = 2
    assert progress.remaining(plan_warmup(Tier.FULL, layer_order=ORDER)).buckets == (128, 512)
    assert progress.remaining(plan_warmup(Tier.TRUNCATED, layer_order=ORDER)).is_empty()


def test_parse_buckets() -> None:
    assert parse_buckets("512,32, 128,32") == (32, 128, 512)
    for bad in ("", "a", "0,32", "-1"):
        with pytest.raises(ValueError):
            parse_buckets(bad)


def test_sized_tokens_exact() -> None:
    engine = FakeEngine("m")
    for bucket in (1, 32, 128, 512, 1500):
        ids = sized_prompt_tokens(DEFAULT_PROMPTS, bucket, engine.encode)
        assert len(ids) == bucket
    a = sized_prompt_tokens(DEFAULT_PROMPTS, 32, engine.encode, variant=0)
    b = sized_prompt_tokens(DEFAULT_PROMPTS, 32, engine.encode, variant=1)
    assert a[0] != b[0]  # variants differ from the first token: no prefix-cache no-op


def test_sized_tokens_from_a_single_short_prompt() -> None:
    engine = FakeEngine("m")
    assert len(sized_prompt_tokens(["hi"], 300, engine.encode)) == 300


def test_sized_text_approximate() -> None:
    for bucket in (32, 128, 512):
        text = sized_prompt_text(DEFAULT_PROMPTS, bucket)
        assert bucket * 4 * 0.5 <= len(text) <= bucket * 4
        assert not text.endswith(" ")


def test_load_prompts(tmp_path: Path) -> None:
    assert load_prompts(None) == list(DEFAULT_PROMPTS)
    as_list = tmp_path / "p.json"
    as_list.write_text(json.dumps(["a b", "  ", "c"]))
    assert load_prompts(as_list) == ["a b", "c"]
    as_object = tmp_path / "o.json"
    as_object.write_text(json.dumps({"prompts": ["x"]}))
    assert load_prompts(as_object) == ["x"]
    as_text = tmp_path / "p.txt"
    as_text.write_text("first prompt\nstill first\n\n\nsecond\n")
    assert load_prompts(as_text) == ["first prompt\nstill first", "second"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [("[1, 2]", "list of strings"), ("{bad", "not JSON"), ("[]", "no prompts"), ("\n\n", "no prompts")],
)
def test_bad_prompts(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "prompts.json"
    path.write_text(content)
    with pytest.raises(PromptsError, match=needle) as info:
        load_prompts(path)
    assert str(path) in str(info.value)
    with pytest.raises(PromptsError, match="cannot read"):
        load_prompts(tmp_path / "absent")


def test_execute_full_then_counts() -> None:
    engine = FakeEngine("m", num_layers=10)
    done: list[int] = []
    layers: list[int] = []
    plan = plan_warmup(Tier.FULL, layer_order=ORDER)
    progress = execute_plan(
        engine,
        plan,
        DEFAULT_PROMPTS,
        WarmupProgress(),
        on_prefill=done.append,
        on_layer=lambda r, t, i: layers.append(i),
        engine_lock=threading.Lock(),
    )
    assert engine.load_order == ORDER  # hot-first order respected
    assert layers == ORDER
    assert done == [32, 32, 128, 128, 512, 512]
    assert progress.prefills == {32: 2, 128: 2, 512: 2}
    # running it again is a no-op
    execute_plan(engine, plan, DEFAULT_PROMPTS, progress, on_prefill=done.append)
    assert len(done) == 6


def test_execute_paused_maps_core_only() -> None:
    engine = FakeEngine("m", num_layers=10)
    execute_plan(engine, plan_warmup(Tier.PAUSED, layer_order=ORDER), DEFAULT_PROMPTS, WarmupProgress())
    assert engine.core_loaded and engine.layers_resident() == 0


def test_execute_truncated_then_top_up() -> None:
    engine = FakeEngine("m", num_layers=10)
    progress = WarmupProgress()
    execute_plan(engine, plan_warmup(Tier.TRUNCATED, layer_order=ORDER), DEFAULT_PROMPTS, progress)
    assert engine.load_order[:3] == [5, 2, 9]
    assert progress.prefills == {32: 1}
    execute_plan(engine, plan_warmup(Tier.FULL, layer_order=ORDER), DEFAULT_PROMPTS, progress)
    assert progress.prefills == {32: 2, 128: 2, 512: 2}


def test_execute_stops_when_told() -> None:
    engine = FakeEngine("m", num_layers=4)
    progress = WarmupProgress()
    calls = iter([False] * 4 + [False, False, True])  # 4 layer steps, then 2 prompts
    with pytest.raises(WarmupStopped):
        execute_plan(
            engine,
            plan_warmup(Tier.FULL, layer_order=[0, 1, 2, 3]),
            DEFAULT_PROMPTS,
            progress,
            should_stop=lambda: next(calls),
        )
    assert sum(progress.prefills.values()) == 2


def test_kv_prefix_saved_then_reused(tmp_path: Path) -> None:
    plan = plan_warmup(Tier.TRUNCATED, layer_order=[0, 1])
    first = execute_plan(FakeEngine("m", 2), plan, DEFAULT_PROMPTS, WarmupProgress(), kv_dir=tmp_path)
    assert (first.kv_saved, first.kv_loaded) == (1, 0)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    engine = FakeEngine("m", 2)
    second = execute_plan(engine, plan, DEFAULT_PROMPTS, WarmupProgress(), kv_dir=tmp_path)
    assert (second.kv_saved, second.kv_loaded) == (0, 1)
    # a different model (other digest) gets its own key, never the stale file
    other = FakeEngine("other", 2)
    ids = sized_prompt_tokens(DEFAULT_PROMPTS, 32, other.encode)
    assert kv_prefix_path(tmp_path, other.model_digest, ids) != next(tmp_path.glob("*.safetensors"))


def test_kv_prefix_stale_file_rejected(tmp_path: Path) -> None:
    engine = FakeEngine("m", 2)
    plan = plan_warmup(Tier.TRUNCATED, layer_order=[0, 1])
    ids = sized_prompt_tokens(DEFAULT_PROMPTS, 32, engine.encode)
    path = kv_prefix_path(tmp_path, engine.model_digest, ids)
    path.write_text(json.dumps({"digest": "sha256:old", "tokens": ids}))
    progress = execute_plan(engine, plan, DEFAULT_PROMPTS, WarmupProgress(), kv_dir=tmp_path)
    assert progress.kv_loaded == 0 and engine.prefix_loaded == []
    assert progress.prefills == {32: 1}  # the warm-up itself went on
