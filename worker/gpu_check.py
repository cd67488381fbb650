"""One short check of the built-in engine's GPU path on an NVIDIA GPU (written for an H200).

    python worker/gpu_check.py [--model DIR] [--dtype bfloat16] [--out FILE]

Prints one JSON object:
  * correctness: CUDA logits vs CPU fp32 logits on a tiny random model; CUDA-graph decode
    vs eager decode (same tokens) for every batch bucket;
  * load: weight bytes / seconds for a cold load (page cache dropped for the files with
    posix_fadvise, which needs no root) through the pinned staging buffers;
  * capture: CUDA-graph capture seconds per decode batch bucket (1/2/4/8);
  * ttft: time to first token for a 128-token prompt, cold (first request after load)
    and warm (after warm-up prefill and graph capture); decode tokens/s, batch 1 and 8.

Without --model it writes a synthetic ~1.1B-parameter Llama (random weights, bf16) to a
temp dir: the device machine has no network and no model cache.  Refuses clearly (exit
2) without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A developer's script beside the worker package (never in the image: the Dockerfiles copy
# warmpool_worker/ only), run from a source checkout without an install (the device machine
# has none): the worker package beside it, the shared core and the dev package (tiny models).
_REPO = Path(__file__).resolve().parent.parent
for _path in (_REPO, _REPO / "worker", _REPO / "dev"):
    sys.path.insert(0, str(_path))


def _evict(model_dir: Path) -> None:
    """Drop the weight files from the page cache so the load reads from disk."""
    for path in model_dir.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _correctness(tmp: Path) -> dict[str, Any]:
    import torch
    from warmpool_dev.testing_models import make_tiny_llama
    from warmpool_worker.builtin.engine import load_engine

    model = make_tiny_llama(tmp / "tiny", layers=3, seed=5, qkv_bias=True, model_type="qwen2")
    cpu = load_engine(model, device="cpu", dtype="float32")
    gpu = load_engine(model, device="cuda", dtype="float32", graph_max_len=128)
    ids = cpu.encode("correctness check on the device")
    diff = float((cpu.forward_logits(ids) - gpu.forward_logits(ids).cpu()).abs().max())
    prompts = [ids, ids[:5], ids[3:], ids[:9], ids, ids[1:], ids[:4], ids[2:]]
    eager = {b: gpu.generate_batch(prompts[:b], 8) for b in (1, 2, 3, 8)}
    gpu.capture_graphs()
    graphed = {b: gpu.generate_batch(prompts[:b], 8) for b in (1, 2, 3, 8)}
    single_eager = [s.token_id for s in cpu.generate(ids, 8)]
    single_graph = [s.token_id for s in gpu.generate(ids, 8)]
    torch.cuda.synchronize()
    return {
        "max_logit_diff_cuda_vs_cpu_fp32": diff,
        "graph_equals_eager": all(eager[b] == graphed[b] for b in eager),
        "graph_generate_equals_cpu": single_eager == single_graph,
        "graph_buckets": gpu.graph_buckets,
    }


def _sleep_round_trip(engine: Any, prompt: list[int]) -> dict[str, Any]:
    """Sleep at levels 1 and 2, wake, and check the greedy tokens are those before.

    Wake GB/s is the resident weights' bytes over the wake (level 1: pinned host -> device;
    level 2: re-read from the files); vLLM publishes 0.1-0.4 s wakes for its sleep mode.
    """
    import torch

    expected = [step.token_id for step in engine.generate(prompt, 8)]
    weight_bytes = sum(t.numel() * t.element_size() for _, t in engine.weights.resident())
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "vllm_published_wake_s": [0.1, 0.4]}
    for level in (1, 2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.sleep(level)
        released = before - torch.cuda.memory_allocated()
        started = time.perf_counter()
        engine.wake()  # weights back, graphs re-captured, one-prompt check
        torch.cuda.synchronize()
        wake_s = time.perf_counter() - started
        started = time.perf_counter()
        again = [step.token_id for step in engine.generate(prompt, 8)]
        torch.cuda.synchronize()
        out[f"level{level}"] = {
            "released_bytes": released,
            "released_share_of_weights": round(released / weight_bytes, 3) if weight_bytes else None,
            "wake_s": round(wake_s, 4),
            "wake_gb_per_s": round(weight_bytes / wake_s / 1e9, 2),
            "first_generation_after_wake_s": round(time.perf_counter() - started, 4),
            "same_greedy_tokens": again == expected,
        }
    return out


def _warm_speed(engine: Any, prompt: list[int], ttft_cold: float) -> dict[str, Any]:
    """After the warm-up prefills and the graph capture: capture seconds per bucket, warm time to
    first token (median of 5), decode tokens/s alone and in a batch of 8."""
    import torch

    for bucket in (32, 128, 512):  # the warm-up prefills
        engine.prefill((prompt * 4)[:bucket])
    capture = engine.capture_graphs()
    capture_s = {str(b): round(s, 3) for b, s in sorted(capture.items())}

    def ttft() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        list(engine.generate(prompt, 1))
        return time.perf_counter() - t0

    warm = sorted(ttft() for _ in range(5))
    started = time.perf_counter()
    steps = list(engine.generate(prompt, 64))
    torch.cuda.synchronize()
    decode1 = len(steps) / (time.perf_counter() - started)
    started = time.perf_counter()
    outs = engine.generate_batch([prompt] * 8, 64)
    torch.cuda.synchronize()
    decode8 = sum(len(o) for o in outs) / (time.perf_counter() - started)
    return {"capture_s": capture_s,
            "ttft_s": {"cold_including_load": round(ttft_cold, 3), "warm_median": round(warm[2], 4)},
            "decode_tokens_per_s": {"batch1": round(decode1, 1), "batch8": round(decode8, 1)}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a HF-layout model dir (default: synthetic 1.1B)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "CUDA is not available: this check needs an NVIDIA GPU"}))
        return 2
    from warmpool_dev.testing_models import make_tiny_llama
    from warmpool_worker.builtin.engine import load_engine

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    with tempfile.TemporaryDirectory(prefix="warmpool-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        result["correctness"] = _correctness(tmp)

        model_dir = args.model
        if model_dir is None:
            started = time.perf_counter()
            model_dir = make_tiny_llama(
                tmp / "synthetic-1b", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192,
                vocab_size=32000, dtype="bfloat16", shards=2, max_position_embeddings=4096, std=0.02,
            )
            result["synthetic_model_write_s"] = round(time.perf_counter() - started, 2)
        _evict(model_dir)

        started = time.perf_counter()
        engine = load_engine(model_dir, device="cuda", dtype=args.dtype)
        mapped = time.perf_counter() - started
        prompt = [(i * 7919) % 1000 + 300 for i in range(128)]
        started = time.perf_counter()
        list(engine.generate(prompt, 1))  # lazy: every layer is loaded on this first use
        torch.cuda.synchronize()
        ttft_cold = time.perf_counter() - started
        engine2 = load_engine(model_dir, device="cuda", dtype=args.dtype)
        _evict(model_dir)
        started = time.perf_counter()
        engine2.load_all()
        torch.cuda.synchronize()
        load_s = time.perf_counter() - started
        del engine2
        torch.cuda.empty_cache()
        result["load"] = {
            "map_s": round(mapped, 4),
            "bytes": engine.bytes_loaded,
            "load_all_s": round(load_s, 3),
            "gb_per_s": round(engine.bytes_loaded / load_s / 1e9, 2),
        }

        result |= _warm_speed(engine, prompt, ttft_cold)
        result["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        result["sleep"] = _sleep_round_trip(engine, prompt)

    c = result["correctness"]
    sleep = result["sleep"]
    result["ok"] = bool(c["graph_equals_eager"] and c["graph_generate_equals_cpu"]
                        and c["max_logit_diff_cuda_vs_cpu_fp32"] < 1e-3
                        and sleep["level1"]["same_greedy_tokens"] and sleep["level2"]["same_greedy_tokens"])
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
