"""The child side of `warmpool bench coldstart`: one baseline (or the floor) in a fresh process.

    python -m warmpool_bench.probe SPEC.json

The spec names the variant, the model, the compute dtype, the request prompt (token ids)
and where to write the result.  Only the standard library is imported before the clock
readings start, so `import torch` (and `import transformers`) is paid inside the figures,
as a real server pays it.  All timestamps are `time.time()` (wall clock), the same clock
the parent read just before it started this process, so the parent can measure every
figure from process start.

Variants:

* ``torch_load``: ``torch.load`` of a pickle checkpoint made from the same weights
  (bench-only: the worker refuses pickle), eager, into the built-in engine;
* ``safetensors_eager``: ``safetensors.torch.load_file`` into the same engine, eager;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained`` + ``generate``;
* ``floor``: ``import torch`` + a plain sequential read of the weight files + the same
  warm-up prefills run on already-loaded weights (the load between them is not counted).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _median(values: list[float]) -> float:
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def _inject_eager(engine: Any, state: dict[str, Any]) -> None:
    """Serve the engine's weight reads from an eagerly loaded state dict instead of the mmap.

    Bench-only surgery on the engine's private loader hooks: the eager baselines must run
    the very same model code, and must not pay an extra copy the real eager loaders would
    not make (the tensors are already private memory), only the dtype cast if one is due.
    """
    from warmpool_worker.builtin.engine.linear import can_pack, pack

    dtype = engine.dtype
    packs = can_pack(dtype, engine.weights.device)

    def materialise(tensor: Any, linear: bool = False) -> Any:
        if tensor.dtype == dtype:
            return tensor
        # converted as the engine converts: a linear layer's matrix packed for oneDNN
        converted = tensor.to(dtype)
        return pack(converted) if linear and packs else converted

    engine.checkpoint.get_tensor = state.__getitem__
    engine.weights.materialise = materialise


def _engine_requests(engine: Any, prompt: list[int], steady: int) -> tuple[float, float, list[float]]:
    """First request, then `steady` more: (wall time the first token was out, first TTFT, steady TTFTs)."""
    started = time.perf_counter()
    for _ in engine.generate(prompt, max_new_tokens=1):
        pass
    first = time.perf_counter() - started
    first_at = time.time()
    steady_s: list[float] = []
    for _ in range(steady):
        t = time.perf_counter()
        for _ in engine.generate(prompt, max_new_tokens=1):
            pass
        steady_s.append(time.perf_counter() - t)
    return first_at, first, steady_s


def run_eager(spec: dict[str, Any], result: dict[str, Any]) -> None:
    import torch

    result["t_imported"] = time.time()
    from warmpool_worker.builtin.engine import load_engine

    model_dir = Path(spec["model_dir"])
    started = time.perf_counter()
    if spec["variant"] == "torch_load":
        state = torch.load(spec["pickle"], map_location="cpu", weights_only=True, mmap=False)
    else:
        from safetensors.torch import load_file

        state = {}
        for name in spec["files"]:
            # load_file hands back tensors over its own mmap (measured: 1 GB "loaded" in 0.04 s),
            # which would make this baseline lazy; the copy makes it the eager read it stands for.
            state.update({key: tensor.clone() for key, tensor in load_file(name, device="cpu").items()})
    result["read_s"] = time.perf_counter() - started
    engine = load_engine(model_dir, "cpu", spec["dtype"])
    _inject_eager(engine, state)
    engine.load_all()
    result["load_s"] = time.perf_counter() - started
    result["t_usable"] = result["t_ready"] = time.time()
    first_at, first, steady = _engine_requests(engine, spec["prompt_ids"], spec["steady"])
    result.update(t_first_token=first_at, first_ttft_s=first, steady_ttft_s=_median(steady))


def run_transformers(spec: dict[str, Any], result: dict[str, Any]) -> None:
    import torch

    result["t_imported_torch"] = time.time()
    from transformers import AutoModelForCausalLM

    result["t_imported"] = time.time()
    started = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    # from_pretrained returns the model in eval mode already
    result["load_s"] = time.perf_counter() - started
    result["t_usable"] = result["t_ready"] = time.time()
    ids = torch.tensor([spec["prompt_ids"]], dtype=torch.long)
    mask = torch.ones_like(ids)

    def one() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    first = one()
    result["t_first_token"] = time.time()
    result["first_ttft_s"] = first
    result["steady_ttft_s"] = _median([one() for _ in range(spec["steady"])])


def run_floor(spec: dict[str, Any], result: dict[str, Any]) -> None:
    import torch  # noqa: F401  (the import is part of the floor)

    result["t_imported"] = time.time()
    from warmpool_bench.pagecache import read_files

    nbytes, read_s = read_files([Path(f) for f in spec["files"]])
    result.update(read_bytes=nbytes, read_s=read_s)
    # Not counted: load every weight, so the prefills below run on already-loaded weights.
    from dataclasses import replace

    from warmpool_worker.builtin.engine import load_engine
    from warmpool_worker.warmup import WarmupProgress, execute_plan, load_prompts, plan_warmup

    from warmpool.contract.api import Tier

    engine = load_engine(Path(spec["model_dir"]), "cpu", spec["dtype"])
    engine.load_all()
    plan = plan_warmup(Tier.FULL, layer_order=list(range(engine.num_layers)), buckets=spec["buckets"],
                       prompts_per_bucket=spec["prompts_per_bucket"], decode_tokens=spec["decode_tokens"],
                       max_context=engine.max_context)
    started = time.perf_counter()
    execute_plan(engine, replace(plan, resident_layers=()), load_prompts(None), WarmupProgress())
    result["warmup_s"] = time.perf_counter() - started
    _, first, steady = _engine_requests(engine, spec["prompt_ids"], spec["steady"])
    result.update(first_ttft_s=first, steady_ttft_s=_median(steady))


RUNNERS = {"torch_load": run_eager, "safetensors_eager": run_eager, "transformers": run_transformers,
           "floor": run_floor}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result: dict[str, Any] = {"variant": spec["variant"]}
    RUNNERS[spec["variant"]](spec, result)
    result["peak_rss_bytes"] = _peak_rss_bytes()
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
