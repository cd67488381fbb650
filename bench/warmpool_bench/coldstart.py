"""`warmpool bench coldstart`: every way to get a model serving, each in a fresh process, side by side.

For each model (the small real SmolLM2-135M, a synthetic Llama of about 1 GB) and each
page-cache state (warm: the weight files cached; cold: evicted with
``posix_fadvise(DONTNEED)``), every variant is started ``--runs`` times as a new process,
round-robin (run 1 of every variant, then run 2...), so drift in the machine's load hits
all variants alike.  Every figure is measured from the wall-clock instant just before the
process was started:

* baselines (``probe.py``): ``torch.load`` of a pickle, ``transformers`` ``from_pretrained``,
  ``safetensors`` ``load_file`` into the built-in engine, and the floor;
* the worker (``warmpool worker serve`` as a real subprocess on loopback): full warm-up,
  truncated tier, and full warm-up with a persisted warm-prefix KV.

The targets are ratios of medians from the same run (see `ratios`); nothing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool_bench.pagecache import make_cold, make_warm
from warmpool_bench.stats import median, ratio, summarise

HOST = "127.0.0.1"
BASELINES = ("torch_load", "transformers", "safetensors_eager")
WORKERS = ("warmpool_full", "warmpool_truncated", "warmpool_kv_prefix")
VARIANTS = (*BASELINES, *WORKERS, "floor")
CACHE_STATES = ("warm", "cold")

#: A request unlike the warm-up prompts, so the KV-prefix variant cannot serve it from a stored prefix.
REQUEST_TEXTS = (
    "Explain, step by step, how a hash map resolves collisions with open addressing, and compare "
    "linear probing with quadratic probing in terms of clustering and cache behaviour.",
    "Draft a polite email to a supplier asking to move next week's delivery from Monday to Thursday.",
)

#: The synthetic model: Llama-shaped (GQA, SwiGLU), about 1.0 GB of bf16 weights, sized so
#: the default runs stay within minutes on 2 shared cores (compute per token ~0.7 GFLOP).
SYNTHETIC_SHAPE: dict[str, Any] = {
    "layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 4, "intermediate": 5632,
    "vocab_size": 32000, "tie": False, "dtype": "bfloat16", "max_position_embeddings": 2048, "std": 0.02,
}
SYNTHETIC_DIR = "bench-synthetic-llama-1g"
#: For the quick smoke test: a tiny random model (a few MB).
TINY_SHAPE: dict[str, Any] = {
    "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 272,
    "dtype": "bfloat16", "max_position_embeddings": 1024,
}

_LOAD_LINE = re.compile(r"warm-up \((\w+)\): (\d+) layer\(s\) resident of (\d+) in ([0-9.]+)s")


@dataclass
class Settings:
    runs: int = 3
    dtype: str = "bfloat16"
    buckets: tuple[int, ...] = (32, 128, 512)
    prompts_per_bucket: int = 1
    decode_tokens: int = 4
    request_tokens: int = 128
    steady: int = 3
    timeout_s: float = 900.0
    threads: int | None = 1  # torch intra-op threads in every child (None: torch's default)
    variants: tuple[str, ...] = VARIANTS
    cache_states: tuple[str, ...] = CACHE_STATES
    work_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "warmpool-bench")


@dataclass
class BenchModel:
    name: str
    model_dir: Path
    work: Path  # bench-only artefacts: the pickle, KV prefixes, logs

    @property
    def files(self) -> list[Path]:
        return sorted(self.model_dir.glob("*.safetensors"))

    @property
    def label(self) -> str:
        if self.model_dir.name == "model":  # the private copy of the small real model
            return f"{self.model_dir.parent.name}: SmolLM2-135M-Instruct (private copy)"
        return f"{self.name}: {self.model_dir.name}"

    @property
    def pickle(self) -> Path:
        return self.work / "weights.pt"

    @property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


# -- preparation ------------------------------------------------------------------------
def _log(message: str) -> None:
    print(f"[bench coldstart] {message}", file=sys.stderr, flush=True)


def prepare_model(size: str, cache_root: Path, work_dir: Path) -> BenchModel:
    """Find or make the model of this size; the pickle copy of its weights is made on first use."""
    model = find_model(size, cache_root, work_dir)
    _make_pickle(model)
    return model


def find_model(size: str, cache_root: Path, work_dir: Path) -> BenchModel:
    """Find or make the model of this size (no pickle: `bench wake` uses this too)."""
    from warmpool_dev.testing_models import make_tiny_llama

    if size == "small":
        from warmpool_dev.model_fetch import default_model_dir

        source = default_model_dir()
        if not (source / "model.safetensors").is_file():
            raise SystemExit(f"{source}: the small real model is missing: run `warmpool model fetch` first")
        # A private copy: other processes (tests, a demo) may hold the shared cache's files
        # mapped, and mapped pages cannot be evicted, so "cold" would silently be warm.
        model_dir = work_dir / size / "model"
        _copy_if_changed(source, model_dir)
    elif size in ("synthetic", "tiny"):
        shape = SYNTHETIC_SHAPE if size == "synthetic" else TINY_SHAPE
        model_dir = cache_root / "models" / (SYNTHETIC_DIR if size == "synthetic" else "bench-tiny-llama")
        marker = model_dir / ".bench-shape.json"
        if not marker.is_file() or json.loads(marker.read_text()) != shape:
            _log(f"generating the {size} random-weight Llama in {model_dir} (once)")
            make_tiny_llama(model_dir, **shape)
            marker.write_text(json.dumps(shape))
    else:
        raise SystemExit(f"unknown model size {size!r} (small | synthetic | tiny)")
    model = BenchModel(size, model_dir, work_dir / size)
    model.work.mkdir(parents=True, exist_ok=True)
    return model


#: The project's own packages, byte-compiled before any timed start (see `compile_sources`).
SOURCE_PACKAGES = ("warmpool", "warmpool_worker", "warmpool_bench")


def compile_sources(packages: Sequence[str] = SOURCE_PACKAGES) -> None:
    """Byte-compile the project's packages, as the worker image does at build (compileall).

    pip compiled everything it installed, torch and transformers included; the project itself
    is an editable install, and with PYTHONDONTWRITEBYTECODE set (as on this machine) its
    modules were compiled again in every timed child: ~0.1 s of the worker's start that no
    pod pays.  Compiling is idempotent and writes only the ignored __pycache__ folders.
    """
    import compileall
    import importlib

    for name in packages:
        for folder in importlib.import_module(name).__path__:
            compileall.compile_dir(folder, quiet=1)


def _copy_if_changed(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if not path.is_file():
            continue
        target = dest / path.name
        if not target.is_file() or target.stat().st_size != path.stat().st_size \
                or target.stat().st_mtime_ns < path.stat().st_mtime_ns:
            shutil.copyfile(path, target)


def _make_pickle(model: BenchModel) -> None:
    """The torch.load baseline's checkpoint: the same tensors, pickled (bench-only, never served)."""
    stamp = model.work / "weights.pt.source"
    source = json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in model.files])
    if model.pickle.is_file() and stamp.is_file() and stamp.read_text() == source:
        return
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for path in model.files:
        state.update(load_file(str(path)))
    torch.save(state, model.pickle)
    stamp.write_text(source)


def request_ids(model: BenchModel, tokens: int) -> list[int]:
    """The benchmark request: exactly `tokens` token ids of text unlike the warm-up prompts."""
    from tokenizers import Tokenizer
    from warmpool_worker.warmup import sized_prompt_tokens

    tokenizer = Tokenizer.from_file(str(model.model_dir / "tokenizer.json"))
    return sized_prompt_tokens(list(REQUEST_TEXTS), tokens, lambda text: list(tokenizer.encode(text).ids))


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("POD_IP", None)  # the worker would bind it
    if threads is not None:
        # Same for every variant.  On an oversubscribed box (more runnable threads than
        # cores) torch's OpenMP pool of one thread per core spends its time in barriers:
        # measured here, a 32-token prefill of the small model took 1.5-3 s with 2 threads
        # against 0.2 s with 1.  Pin it, or the benchmark measures the scheduler.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


# -- one run of one variant ---------------------------------------------------------------
def run_probe(variant: str, model: BenchModel, settings: Settings, prompt: list[int]) -> dict[str, Any]:
    """A baseline or the floor in a fresh interpreter; figures in seconds from process start."""
    spec_path = model.work / f"probe-{variant}.json"
    out_path = model.work / f"probe-{variant}.out.json"
    out_path.unlink(missing_ok=True)
    spec = {
        "variant": variant, "model_dir": str(model.model_dir), "files": [str(f) for f in model.files],
        "pickle": str(model.pickle), "dtype": settings.dtype, "prompt_ids": prompt, "steady": settings.steady,
        "buckets": list(settings.buckets), "prompts_per_bucket": settings.prompts_per_bucket,
        "decode_tokens": settings.decode_tokens, "out": str(out_path),
    }
    spec_path.write_text(json.dumps(spec))
    log_path = model.work / f"probe-{variant}.log"
    with log_path.open("wb") as log:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "warmpool_bench.probe", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=_env(settings.threads))
        try:
            code = proc.wait(timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            return {"error": f"timed out after {settings.timeout_s}s"}
    if code != 0 or not out_path.is_file():
        return {"error": f"exit {code}: {log_path.read_text(errors='replace')[-1500:]}"}
    raw = json.loads(out_path.read_text())
    run: dict[str, Any] = {
        "import_s": raw["t_imported"] - t0,
        "peak_rss_bytes": raw["peak_rss_bytes"],
        "first_ttft_s": raw["first_ttft_s"],
        "steady_ttft_s": raw["steady_ttft_s"],
    }
    if variant == "floor":
        run.update(read_s=raw["read_s"], read_bytes=raw["read_bytes"], warmup_s=raw["warmup_s"])
        run["floor_s"] = run["import_s"] + raw["read_s"] + raw["warmup_s"]
        run["read_gbps"] = raw["read_bytes"] / raw["read_s"] / 1e9 if raw["read_s"] > 0 else None
    else:
        run.update(load_s=raw["load_s"], usable_s=raw["t_usable"] - t0, ready_s=raw["t_ready"] - t0,
                   first_token_s=raw["t_first_token"] - t0)
        if "read_s" in raw:
            run["read_s"] = raw["read_s"]
        if "t_imported_torch" in raw:
            run["import_torch_s"] = raw["t_imported_torch"] - t0
    run["first_over_steady"] = ratio(run["first_ttft_s"], run["steady_ttft_s"])
    return run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _http(url: str, body: object | None = None, timeout: float = 600.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def phase_timestamps(metrics_text: str) -> dict[str, float]:
    from warmpool_dev.timeline import parse_phase_metric

    from warmpool.contract.metrics import METRIC_PHASE_TIMESTAMP

    return parse_phase_metric(metrics_text, METRIC_PHASE_TIMESTAMP)


def _vm_hwm_bytes(pid: int) -> int | None:
    """The process's peak resident set so far (VmHWM), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parse_load_seconds(log_text: str) -> tuple[float | None, int | None]:
    """(seconds, layers) of the worker's forced layer load, from its own log line; None if absent."""
    found = _LOAD_LINE.findall(log_text)
    if not found:
        return None, None
    _tier, resident, _total, seconds = found[0]
    return float(seconds), int(resident)


def worker_command(variant: str, model: BenchModel, settings: Settings, port: int) -> list[str]:
    command = [
        sys.executable, "-m", "warmpool", "worker", "serve", "--model", str(model.model_dir),
        "--host", HOST, "--port", str(port), "--device", "cpu", "--dtype", settings.dtype,
        "--buckets", ",".join(map(str, settings.buckets)),
        "--prompts-per-bucket", str(settings.prompts_per_bucket),
        "--decode-tokens", str(settings.decode_tokens),
    ]
    if variant == "warmpool_truncated":
        # Hold the worker at the truncated tier from its first memory reading: a configured
        # capacity far above anything real, and a truncate threshold just above 0 % used,
        # so any real usage lands between truncate (1e-9 %) and pause (100 %).
        command += ["--memory-capacity-bytes", str(1 << 50), "--tier-thresholds", "0.000000001,100,0"]
    if variant == "warmpool_kv_prefix":
        command += ["--kv-prefix-dir", str(model.work / "kv")]
    return command


def run_worker(variant: str, model: BenchModel, settings: Settings, prompt: list[int],
               log_name: str | None = None) -> dict[str, Any]:
    """`warmpool worker serve` as a real subprocess: process start -> /readyz 200 -> first completion."""
    port = _free_port()
    base = f"http://{HOST}:{port}"
    log_path = model.work / (log_name or f"{variant}.log")
    with log_path.open("wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(worker_command(variant, model, settings, port), stdout=log,
                                stderr=subprocess.STDOUT, env=_env(settings.threads))
        try:
            return _drive_worker(proc, base, t0, settings, prompt, log_path)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)


def _drive_worker(proc: subprocess.Popen[bytes], base: str, t0: float, settings: Settings,
                  prompt: list[int], log_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + settings.timeout_s
    ready_body: dict[str, Any] | None = None
    # 20 ms polls: fine enough against start-ups of seconds, light enough not to steal a core
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return {"error": f"worker exited {proc.returncode}: {log_path.read_text(errors='replace')[-1500:]}"}
        with contextlib.suppress(OSError, urllib.error.URLError):
            status, payload = _http(base + "/readyz", timeout=5)
            if status == 200:
                ready_body = json.loads(payload)
                break
        time.sleep(0.02)
    if ready_body is None:
        return {"error": f"not ready after {settings.timeout_s}s"}
    seen_ready = time.time()
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

    def one() -> float:
        started = time.perf_counter()
        status, payload = _http(base + "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {payload[:300]!r}")
        return time.perf_counter() - started

    first = one()
    first_at = time.time()
    steady = [one() for _ in range(settings.steady)]
    _, metrics_payload = _http(base + "/metrics", timeout=30)
    phases = phase_timestamps(metrics_payload.decode())
    peak = _vm_hwm_bytes(proc.pid)
    load_s, forced = parse_load_seconds(log_path.read_text(errors="replace"))
    mapped = phases.get("weights_mapped")
    ready_at = phases.get("ready", seen_ready)
    warm = ready_body.get("warmup", {})
    run: dict[str, Any] = {
        "ready_s": ready_at - t0,
        "mapped_s": None if mapped is None else mapped - t0,
        "load_s": load_s,
        "usable_s": None if mapped is None or load_s is None else mapped - t0 + load_s,
        "warmup_s": None if "warmup_done" not in phases or mapped is None or load_s is None
        else phases["warmup_done"] - mapped - load_s,
        "first_token_s": first_at - t0,
        "first_ttft_s": first,
        "steady_ttft_s": median(steady),
        "peak_rss_bytes": peak,
        "layers_forced": forced,
        "tier": ready_body.get("tier"),
        "kv_loaded": warm.get("kv_loaded"),
        "kv_saved": warm.get("kv_saved"),
        "spawned_at": t0,
        "phases": phases,  # Unix time of each cold-start phase the worker reached
    }
    run["first_over_steady"] = ratio(run["first_ttft_s"], run["steady_ttft_s"])
    return run


# -- the whole benchmark ------------------------------------------------------------------
def _cache_paths(variant: str, model: BenchModel) -> list[Path]:
    return [model.pickle] if variant == "torch_load" else model.files


def set_cache_state(state: str, paths: list[Path]) -> float | None:
    return make_warm(paths) if state == "warm" else make_cold(paths)


def run_variant(variant: str, model: BenchModel, settings: Settings, prompt: list[int]) -> dict[str, Any]:
    if variant in WORKERS:
        return run_worker(variant, model, settings, prompt)
    return run_probe(variant, model, settings, prompt)


def bench_model(model: BenchModel, settings: Settings,
                runner: Callable[[str, BenchModel, Settings, list[int]], dict[str, Any]] = run_variant,
                ) -> dict[str, Any]:
    prompt = request_ids(model, settings.request_tokens)
    if "warmpool_kv_prefix" in settings.variants:
        # Not timed: the first start computes and saves the warm-prefix KV that the timed runs reload.
        _log(f"{model.name}: priming the warm-prefix KV store")
        primed = run_worker("warmpool_kv_prefix", model, settings, prompt, log_name="kv-prime.log")
        if "error" in primed:
            _log(f"{model.name}: KV priming failed: {primed['error']}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {c: [] for c in settings.cache_states} for v in settings.variants
    }
    for attempt in range(settings.runs):
        for state in settings.cache_states:
            for variant in settings.variants:
                resident = set_cache_state(state, _cache_paths(variant, model))
                load_before = os.getloadavg()[0]
                started = time.monotonic()
                run = runner(variant, model, settings, prompt)
                run.update(run_index=attempt, resident_before=resident, loadavg_1m=load_before)
                runs[variant][state].append(run)
                _log(f"{model.name} run {attempt + 1}/{settings.runs} {state:<4} {variant:<18} "
                     f"{time.monotonic() - started:6.1f}s " + (run.get("error", "")[:200] if "error" in run else
                     f"ready {run.get('ready_s') or run.get('floor_s') or 0:.2f}s"))
    variants = {
        v: {c: {"median": summarise([r for r in rs if "error" not in r]), "runs": rs} for c, rs in states.items()}
        for v, states in runs.items()
    }
    return {
        "label": model.label,
        "model_dir": str(model.model_dir),
        "weight_bytes": model.weight_bytes,
        "files": [f.name for f in model.files],
        "request_tokens": len(prompt),
        "variants": variants,
        "ratios": ratios(variants, settings.cache_states),
    }


def _med(variants: dict[str, Any], variant: str, state: str, key: str) -> float | None:
    value = variants.get(variant, {}).get(state, {}).get("median", {}).get(key)
    return None if value is None else float(value)


def ratios(variants: dict[str, Any], states: Sequence[str] = CACHE_STATES) -> dict[str, dict[str, float | None]]:
    """The issue's target ratios, per cache state, from the medians (computed, never asserted)."""
    out: dict[str, dict[str, float | None]] = {}
    for state in states:
        def m(variant: str, key: str, state: str = state) -> float | None:
            return _med(variants, variant, state, key)

        read_s = m("floor", "read_s")
        figures: dict[str, float | None] = {
            # weights usable: transformers (import + from_pretrained) / warmpool (map + forced load)
            "usable_speedup_vs_transformers": ratio(m("transformers", "usable_s"), m("warmpool_full", "usable_s")),
            "ready_over_floor": ratio(m("warmpool_full", "ready_s"), m("floor", "floor_s")),
            "ready_over_floor_kv_prefix": ratio(m("warmpool_kv_prefix", "ready_s"), m("floor", "floor_s")),
            # bandwidth reached by the load phase as a share of plain sequential reads of the same bytes
            "load_bandwidth_fraction": ratio(read_s, m("warmpool_full", "load_s")),
            "load_over_read_floor": ratio(m("warmpool_full", "load_s"), read_s),
        }
        for variant in (*BASELINES, *WORKERS):
            figures[f"first_over_steady.{variant}"] = ratio(m(variant, "first_ttft_s"), m(variant, "steady_ttft_s"))
        for variant in BASELINES:
            figures[f"load_over_read_floor.{variant}"] = ratio(m(variant, "load_s"), read_s)
            figures[f"ready_speedup_of_full_vs.{variant}"] = ratio(m(variant, "first_token_s"),
                                                                    m("warmpool_full", "first_token_s"))
        out[state] = figures
    return out


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_total_bytes"] = int(line.split()[1]) * 1024
    for package in ("torch", "transformers", "safetensors", "tokenizers"):
        with contextlib.suppress(md.PackageNotFoundError):
            info[f"{package}_version"] = md.version(package)
    return info


def run_coldstart(sizes: Sequence[str], settings: Settings, cache_root: Path) -> dict[str, Any]:
    started = time.time()
    result: dict[str, Any] = {
        "benchmark": "coldstart",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine_info(),
        "settings": {
            "runs": settings.runs, "dtype": settings.dtype, "device": "cpu", "buckets": list(settings.buckets),
            "prompts_per_bucket": settings.prompts_per_bucket, "decode_tokens": settings.decode_tokens,
            "request_tokens": settings.request_tokens, "steady_requests": settings.steady,
            "variants": list(settings.variants), "cache_states": list(settings.cache_states),
            "torch_threads": settings.threads, "sources_compiled": list(SOURCE_PACKAGES),
        },
        "models": {},
    }
    compile_sources()
    for size in sizes:
        model = prepare_model(size, cache_root, settings.work_dir)
        _log(f"{size}: {model.model_dir} ({model.weight_bytes / 1e9:.2f} GB of weights)")
        result["models"][size] = bench_model(model, settings)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.time() - started
    return result
