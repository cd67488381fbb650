"""The replay's timings come from this machine's results files: the right figures are picked from
hand-made wake.json / coldstart.json / serve.json, and a missing file or figure is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from warmpool_bench.predict import settings_from_measured
from warmpool_bench.predict_inputs import MeasuredInputError, load_measured, overridden_batch

pytestmark = pytest.mark.unit


MIB = 2**20
#: What the worker held awake and asleep (MiB): anonymous memory, the weight file, other files.
HELD = {"anon_awake_bytes": 300 * MIB, "weights_file_awake_bytes": 250 * MIB, "other_file_awake_bytes": 50 * MIB,
        "anon_asleep_bytes": 100 * MIB, "weights_file_asleep_bytes": 0, "other_file_asleep_bytes": 50 * MIB}


def _write(folder: Path, readyz: list[float], wake: list[float], steady: float = 0.1, tokens: int = 128,
           held: dict[str, int] = HELD) -> None:
    variants = {
        "new_pod": {"runs": [{"readyz_s": v} for v in readyz], "summary": {"loadavg_1m": 3.0}},
        "wake_l1": {"runs": [{"wake_call_s": v} for v in wake], "summary": {"loadavg_1m": 2.0, **held}},
    }
    (folder / "wake.json").write_text(json.dumps({"models": {"small": {"variants": variants}}}))
    cold = {"models": {"small": {"request_tokens": tokens, "variants": {
        "warmpool_full": {"cold": {"median": {"steady_ttft_s": steady}}}}}}}
    (folder / "coldstart.json").write_text(json.dumps(cold))
    levels = {str(c): {"concurrency": c, "steady_tok_s": speed} for c, speed in ((1, 16.0), (2, 28.0), (4, 40.0))}
    serve = {"settings": {"max_batch": 6}, "servers": {"warmpool": {"levels": levels}, "llama_cpp": {"levels": {}}}}
    (folder / "serve.json").write_text(json.dumps(serve))


def test_figures_are_read_from_the_results_files(tmp_path: Path) -> None:
    _write(tmp_path, readyz=[20.0, 30.0, 40.0], wake=[0.5, 0.4, 0.6])
    measured = load_measured(tmp_path)
    assert measured.cold_start.median_s == 30.0 and measured.cold_start.p95_s == pytest.approx(39.0)
    assert measured.cold_start.runs == 3 and measured.cold_start.loadavg_1m == 3.0
    assert measured.wake.median_s == 0.5 and measured.wake.p95_s == pytest.approx(0.59)
    assert measured.prefill_tokens_per_s == pytest.approx(1280.0)
    assert measured.memory is not None
    assert (measured.memory.awake_bytes, measured.memory.asleep_bytes) == (600 * MIB, 150 * MIB)
    settings = settings_from_measured(measured, (60.0,))
    assert [(u.label, u.start_s, u.lead_s, u.wakes) for u in settings.scale_ups] == [
        ("new pod (measured)", 30.0, pytest.approx(39.0), False), ("wake (measured)", 0.5, pytest.approx(0.59), True),
        ("sensitivity", 60.0, 60.0, False)]
    assert settings.memory == measured.memory
    # Decode: alone at concurrency 1; the speed-up linear between measured levels, held past the last one.
    assert settings.decode_tokens_per_s == 16.0
    assert settings.speedups == pytest.approx((1.0, 1.75, 2.125, 2.5, 2.5, 2.5))
    assert settings.service.slots == 6 and "serve.json" in settings.decode_source
    one = overridden_batch(measured.batch, 20.0, 1)
    assert one.decode_tokens_per_s == 20.0 and one.speedups == (1.0,) and "--requests-per-pod" in one.source


def test_a_missing_file_or_figure_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(MeasuredInputError, match=r"wake\.json: cannot read"):
        load_measured(tmp_path)
    _write(tmp_path, readyz=[], wake=[0.5])
    with pytest.raises(MeasuredInputError, match="new_pod has no positive 'readyz_s'"):
        load_measured(tmp_path)
    _write(tmp_path, readyz=[30.0], wake=[0.5], steady=0.0)
    with pytest.raises(MeasuredInputError, match=r"steady TTFT 0\.0"):
        load_measured(tmp_path)
    (tmp_path / "coldstart.json").write_text("{}")
    with pytest.raises(MeasuredInputError, match=r"coldstart\.json: no models"):
        load_measured(tmp_path)
    _write(tmp_path, readyz=[30.0], wake=[0.5], held={**HELD, "anon_asleep_bytes": -1})
    with pytest.raises(MeasuredInputError, match="wake_l1 summary lacks a non-negative anon_asleep_bytes"):
        load_measured(tmp_path)
    _write(tmp_path, readyz=[30.0], wake=[0.5])
    (tmp_path / "serve.json").unlink()
    with pytest.raises(MeasuredInputError, match=r"serve\.json: cannot read.*bench serve"):
        load_measured(tmp_path)
    (tmp_path / "serve.json").write_text(json.dumps({"settings": {"max_batch": 4}, "servers": {"warmpool": {
        "levels": {"2": {"concurrency": 2, "steady_tok_s": 30.0}}}}}))
    with pytest.raises(MeasuredInputError, match="steady_tok_s at concurrency 1"):
        load_measured(tmp_path)
