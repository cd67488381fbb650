"""A warm-up whose buckets settled early reads complete in status.pods: the worker exports what each
bucket needs (``warmpool_warmup_needed_prefills``: a settled bucket's prefills until it settled) and
the operator counts done of that, per bucket, instead of done of the plan's ceiling."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_operator.io.worker_metrics import parse_metrics
from warmpool_operator.model import Sample
from warmpool_operator.rules.observation import PodObservation
from warmpool_operator.rules.progress import pod_progress
from warmpool_worker import warmup
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.builtin.runtime import WorkerRuntime
from warmpool_worker.cli import build_parser, serve_config
from warmpool_worker.metrics import WorkerMetrics

from warmpool.contract.api import Tier

pytestmark = pytest.mark.unit


def _progress(sample: Sample) -> tuple[int | None, int | None]:
    pod = PodObservation(uid="u", name="m-0", ready=False, terminating=False, sample=sample, decision=None)
    entry = pod_progress(pod, None, None)
    return entry.prefills_done, entry.prefills_planned


def test_a_bucket_that_settled_early_counts_complete() -> None:
    worker = WorkerMetrics(process_start=1000.0)
    worker.set_planned({32: 4, 128: 4})
    for _ in range(2):
        worker.warmup_prefill_done(32)
    worker.bucket_settled(32, 2)  # two in a row agreed: the ceiling of 4 is not needed
    for _ in range(4):
        worker.warmup_prefill_done(128)  # never settled: ran to the ceiling
    sample = parse_metrics(worker.render().decode())
    assert sample.needed_prefills == {"32": 2.0, "128": 4.0}
    assert _progress(sample) == (6, 6)


def test_a_bucket_still_running_is_not_complete_and_extra_prefills_do_not_hide_it() -> None:
    worker = WorkerMetrics(process_start=1000.0)
    worker.set_planned({32: 2, 128: 2}, settled={32: 2})
    for _ in range(3):  # an earlier warm-up's prefills of 32 count at most what 32 needs
        worker.warmup_prefill_done(32)
    worker.warmup_prefill_done(128)
    assert _progress(parse_metrics(worker.render().decode())) == (3, 4)


def test_a_deeper_plan_keeps_a_settled_buckets_count() -> None:
    worker = WorkerMetrics(process_start=1000.0)
    worker.set_planned({32: 8, 128: 8}, settled={32: 3})
    assert parse_metrics(worker.render().decode()).needed_prefills == {"32": 3.0, "128": 8.0}


def test_a_worker_without_the_gauge_is_counted_against_its_plan() -> None:
    sample = Sample(prefills={"32": 2.0}, planned_prefills={"32": 4.0})
    assert _progress(sample) == (2, 4)


def test_the_real_runtime_exports_a_settled_warm_up_as_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    # A rule that any two prefills satisfy: the settle is certain on a noisy host (the rule itself
    # is tested in test_warmup_settle*); what is under test is the count the runtime exports.
    defaults = warmup.execute_plan.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "settle", warmup.SettleRule(tolerance=1e9))
    model = make_tiny_llama(tmp_path / "tiny", layers=2, max_position_embeddings=256)
    config = serve_config(build_parser().parse_args(
        ["serve", "--model", str(model), "--device", "cpu", "--buckets", "16,32", "--prompts-per-bucket", "5"]))
    runtime = WorkerRuntime(config, "cpu")
    runtime.prompts = list(warmup.DEFAULT_PROMPTS)
    engine = load_engine(model, "cpu", "float32")
    assert runtime.run_plan(engine, runtime.plan(Tier.FULL, engine), None)
    sample = parse_metrics(runtime.metrics.render().decode())
    assert sample.planned_prefills == {"16": 5.0, "32": 5.0}
    assert sample.needed_prefills == {"16": 2.0, "32": 2.0}
    assert _progress(sample) == (4, 4)
