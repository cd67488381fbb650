"""`warmpool bench wake`: from the decision to the first token served, four ways to get capacity.

For each model (SmolLM2-135M, the ~1 GB synthetic Llama of `bench coldstart`), every variant
is run ``--rounds`` times round-robin (round 1 of every variant, then round 2..., the order
rotated by one each round), so drift in the machine's load hits them alike:

* ``wake_l1`` / ``wake_l2``: a real ``warmpool worker serve`` subprocess on loopback, warm,
  is put to sleep (``POST /control/sleep``, untimed); the clock starts just before
  ``POST /control/wake`` and stops when the first completion after it is answered;
* ``request_wake_l1`` / ``request_wake_l2``: the same sleep, then the completion itself wakes
  the worker (the clock: that request);
* ``copies_wake_l1`` / ``copies_wake_l2``: the same as ``wake_lN`` on a second worker that
  serves the checkpoint in float32, so its weights are converted copies in anonymous memory
  (the CPU analogue of weights copied to device memory): the sleep-memory target is judged here;
* ``fresh_process``: `bench coldstart`'s own worker run (process start -> /readyz 200 -> first token);
* ``new_pod``: a WarmModel on the local cluster scaled from zero pods to one, the operator from
  this checkout running as a local subprocess (`wake_pod`).

Around every sleep the worker's memory is read from /proc/PID/smaps (`wake_figures`), beside
the worker's own ``released_bytes``; the page-cache residency of the weight files is recorded
before every wake.  Every figure is reported; nothing is asserted or tuned.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from warmpool_bench.coldstart import (
    HOST,
    BenchModel,
    Settings,
    _env,
    _free_port,
    find_model,
    machine_info,
    request_ids,
    run_worker,
    worker_command,
)
from warmpool_bench.pagecache import make_warm, resident_fraction
from warmpool_bench.pod_start import process_steps
from warmpool_bench.stats import median, ratio
from warmpool_bench.wake_figures import (
    MemoryBreakdown,
    beyond_mapping_bytes,
    memory_figures,
    parse_smaps,
    side_figures,
    summarise_runs,
    targets,
)
from warmpool_bench.wake_settings import WAKE_VARIANTS, WakeSettings

COPIES_DTYPE = "float32"
TOKEN = "bench-wake-token"


def _log(message: str) -> None:
    print(f"[bench wake] {message}", file=sys.stderr, flush=True)


# -- a worker that sleeps and wakes ------------------------------------------------------------
class SleepyWorker:
    """A long-lived `warmpool worker serve` subprocess (loopback, control token) to put to sleep."""

    def __init__(self, model: BenchModel, settings: Settings, name: str) -> None:
        self.model = model
        self.settings = settings
        self.name = name
        self.port = _free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.token_file = model.work / "control-token"
        self.log_path = model.work / f"sleepy-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.token_file.write_text(TOKEN + "\n")
        command = [*worker_command("warmpool_full", self.model, self.settings, self.port),
                   "--control-token-file", str(self.token_file), "--wake-timeout", str(self.settings.timeout_s)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(self.settings.threads))
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if self.call("GET", "/readyz", timeout=5)[0] == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready after {self.settings.timeout_s:g}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:] if self.log_path.exists() else ""

    def call(self, method: str, path: str, body: object | None = None, timeout: float | None = None,
             ) -> tuple[int, Any]:
        data = b"" if body is None and method == "POST" else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.settings.timeout_s) as response:
                raw = response.read()
                status = int(response.status)
        except urllib.error.HTTPError as error:
            raw, status = error.read(), int(error.code)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def complete(self, prompt: list[int]) -> float:
        """One completion of one token: its seconds (the first token is out when it is answered)."""
        started = time.perf_counter()
        status, body = self.call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {str(body)[:300]}")
        return time.perf_counter() - started

    def control(self, path: str, body: object | None = None, method: str = "POST") -> dict[str, Any]:
        status, answer = self.call(method, path, body)
        if status != 200 or not isinstance(answer, dict):
            raise RuntimeError(f"{method} {path} failed ({status}): {str(answer)[:300]}")
        return answer

    def metric(self, name: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        request = urllib.request.Request(self.base + "/metrics")
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and not sample.labels:
                    return float(sample.value)
        return None

    def memory(self) -> MemoryBreakdown:
        assert self.proc is not None
        text = Path(f"/proc/{self.proc.pid}/smaps").read_text()
        return parse_smaps(text, [str(f.resolve()) for f in self.model.files])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def model_beyond_mapping(model: BenchModel, dtype: str) -> int:
    """What the engine holds outside the files' mapping at `dtype`, from the checkpoint's headers."""
    from warmpool_worker.checkpoint import read_safetensors_header

    pairs = [(t.dtype, t.shape) for f in model.files for t in read_safetensors_header(f).tensors.values()]
    return beyond_mapping_bytes(pairs, dtype)


def run_sleep_wake(worker: SleepyWorker, level: int, woken_by: str, prompt: list[int], steady: int,
                   beyond_mapping: int) -> dict[str, Any]:
    """Sleep at `level` (untimed, memory read around it), then the timed wake -> first token."""
    awake = worker.memory()
    started = time.perf_counter()
    slept = worker.control("/control/sleep", {"level": level})
    sleep_call_s = time.perf_counter() - started
    if not slept.get("sleeping") or slept.get("level") != level:
        raise RuntimeError(f"the worker did not go to sleep at level {level}: {slept}")
    asleep = worker.memory()
    run: dict[str, Any] = {"sleep_call_s": sleep_call_s, "released_bytes": slept.get("released_bytes"),
                           **memory_figures(awake, asleep, beyond_mapping),
                           "resident_before": resident_fraction(worker.model.files)}
    if woken_by == "control":
        started = time.perf_counter()
        woke = worker.control("/control/wake")
        run["wake_call_s"] = time.perf_counter() - started
        first = worker.complete(prompt)
        run["first_ttft_after_wake_s"] = first
        run["decision_to_first_token_s"] = run["wake_call_s"] + first
        run["engine_wake_s"] = woke.get("last_wake_seconds")
    else:
        on_request_before = worker.metric("warmpool_wakes_on_request_total") or 0.0
        run["decision_to_first_token_s"] = worker.complete(prompt)
        run["engine_wake_s"] = worker.control("/control/sleep", method="GET").get("last_wake_seconds")
        run["wakes_on_request"] = (worker.metric("warmpool_wakes_on_request_total") or 0.0) - on_request_before
    steady_s = [worker.complete(prompt) for _ in range(steady)]
    run["steady_ttft_s"] = median(steady_s)
    run["first_over_steady"] = ratio(run.get("first_ttft_after_wake_s", run["decision_to_first_token_s"]),
                                     run["steady_ttft_s"])
    state = worker.control("/control/sleep", method="GET")
    if state.get("sleeping"):
        raise RuntimeError(f"the worker still sleeps after the wake: {state}")
    return run


def fresh_process(model: BenchModel, settings: WakeSettings, prompt: list[int]) -> dict[str, Any]:
    """`bench coldstart`'s worker run: every figure from the instant before the process started."""
    run = run_worker("warmpool_full", model, settings.coldstart(), prompt, log_name="fresh-process.log")
    if "error" not in run:
        run["decision_to_first_token_s"] = run["first_token_s"]
        run["steps"] = process_steps(run["spawned_at"], run["phases"])
    return run


# -- the whole benchmark ----------------------------------------------------------------------
def round_order(variants: Sequence[str], round_index: int) -> list[str]:
    """The variants of one round, rotated by the round's index (each takes every position in turn)."""
    if not variants:
        return []
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


def bench_model(model: BenchModel, settings: WakeSettings,
                new_pod: Callable[[BenchModel, list[int]], dict[str, Any]] | None) -> dict[str, Any]:
    prompt = request_ids(model, settings.request_tokens)
    make_warm(model.files)  # every variant here starts from a cached checkpoint; recorded per wake
    workers: dict[str, SleepyWorker] = {}
    needed = {WAKE_VARIANTS[v][0] for v in settings.variants if v in WAKE_VARIANTS}
    beyond: dict[str, int] = {}
    for kind in sorted(needed):
        dtype = settings.dtype if kind == "served" else COPIES_DTYPE
        worker = SleepyWorker(model, settings.coldstart(dtype), kind)
        _log(f"{model.name}: starting the {kind} worker ({dtype})")
        worker.start()
        workers[kind] = worker
        beyond[kind] = model_beyond_mapping(model, dtype)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in settings.variants}
    try:
        for index in range(settings.rounds):
            for variant in round_order(settings.variants, index):
                load = os.getloadavg()[0]
                started = time.monotonic()
                try:
                    if variant in WAKE_VARIANTS:
                        kind, level, woken_by = WAKE_VARIANTS[variant]
                        run = run_sleep_wake(workers[kind], level, woken_by, prompt, settings.steady, beyond[kind])
                    elif variant == "fresh_process":
                        run = fresh_process(model, settings, prompt)
                    elif new_pod is not None:
                        run = new_pod(model, prompt)
                    else:
                        run = {"error": "no cluster"}
                except Exception as error:  # a failed run is reported with the others; the rounds go on
                    run = {"error": f"{type(error).__name__}: {error}"}
                run.update(round=index, loadavg_1m=load)
                runs[variant].append(run)
                figure = run.get("decision_to_first_token_s")
                took = time.monotonic() - started
                _log(f"{model.name} round {index + 1}/{settings.rounds} {variant:<16} {took:6.1f}s "
                     + (str(run["error"])[:300] if "error" in run else f"decision -> first token {figure:.3f}s"))
    finally:
        for worker in workers.values():
            worker.stop()
    summaries = {v: summarise_runs(rs) for v, rs in runs.items()}
    return {
        "label": model.label,
        "model_dir": str(model.model_dir),
        "weight_bytes": model.weight_bytes,
        "request_tokens": len(prompt),
        "beyond_mapping_bytes": beyond,
        "variants": {v: {"summary": summaries[v], "runs": rs} for v, rs in runs.items()},
        "targets": targets(summaries, judge_wake_p95=model.name == "small"),
        "side_figures": side_figures(summaries),
    }


def run_wake(sizes: Sequence[str], settings: WakeSettings, cache_root: Path,
             on_model: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
    """Every model in turn; `on_model` gets the results so far after each (written as they come,
    so a run cut short keeps the models it finished)."""
    started = time.time()
    result: dict[str, Any] = {
        "benchmark": "wake",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine_info(),
        "settings": {
            "rounds": settings.rounds, "dtype": settings.dtype, "copies_dtype": COPIES_DTYPE, "device": "cpu",
            "buckets": list(settings.buckets), "prompts_per_bucket": settings.prompts_per_bucket,
            "decode_tokens": settings.decode_tokens, "request_tokens": settings.request_tokens,
            "steady_requests": settings.steady, "variants": list(settings.variants),
            "torch_threads": settings.threads,
        },
        "models": {},
    }
    models = [find_model(size, cache_root, settings.work_dir) for size in sizes]
    pods = None
    if "new_pod" in settings.variants:
        from warmpool_bench.wake_pod import NewPods

        pods = NewPods(settings, settings.work_dir / "pods")
    try:
        if pods is not None:
            pods.start([m.model_dir for m in models])
        for model in models:
            _log(f"{model.name}: {model.model_dir} ({model.weight_bytes / 1e9:.2f} GB of weights)")
            result["models"][model.name] = bench_model(model, settings, pods.measure if pods is not None else None)
            if on_model is not None:
                result["machine"]["loadavg_end"] = list(os.getloadavg())
                result["wall_s"] = time.time() - started
                on_model(result)
    finally:
        if pods is not None:
            pods.stop()
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.time() - started
    return result
