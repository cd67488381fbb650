"""`warmpool bench cache`: the node cache's fill from a real S3 store (SeaweedFS on loopback),
side by side with a plain download of the same objects from the same store to the same disk.

One run, one store, one model (the ~1 GB synthetic Llama by default):

1. the model is pushed once as revision r1 (``warmpool model push``'s code), and a copy with
   10 % of its weight blocks changed (one float's lowest byte in each) as r2;
2. ``rounds`` times, one after the other so that load drift hits all alike: a **raw read** (boto3
   whole-object GETs of r1's files, bytes discarded), the fill's own ranged GETs (bytes
   discarded), a **download** (boto3's ``download_file`` of r1's objects to files beside the
   caches: its managed transfer, several ranged GETs at once, no fsync) and a **fill** of r1
   into an empty cache (ranged GETs of every block, SHA-256 verified, written once into the
   revision's files, fdatasynced and journaled, published);
3. r2 filled into a cache that holds r1: bytes transferred / bytes of a full fill;
4. r1 filled again on that node: bytes downloaded (a node that holds the revision).

5. time to the worker's first layer: a full fill before the worker starts against a hot-first
   partial fill with the worker started at once, ``first_layer_rounds`` alternating rounds
   (``cache_first_layer.py``).

Targets, judged as met or missed, never tuned to: fill throughput >= 80 % of the download's
(medians; the fill makes every byte durable before it publishes, the download fsyncs nothing);
the 10 % revision <= 15 % of a full fill's bytes; a held revision 0 bytes; first layer with the
partial fill <= 0.3x the full fill's (medians).  The raw read and the ranged GETs are context.
"""

from __future__ import annotations

import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmpool_nodecache.manifest import DEFAULT_BLOCK_SIZE

TARGET_FILL_VS_DOWNLOAD = 0.80
TARGET_DELTA_BYTES = 0.15
CHANGED_FRACTION = 0.10


def _log(message: str) -> None:
    print(f"[bench cache] {message}", file=sys.stderr, flush=True)


class CountingSource:
    """A real source, with the bytes of every range it served counted (what the fill transferred).

    The fill fetches from several threads at once: the counters are updated under a lock.
    """

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes, self.requests = inner, 0, 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return str(self.inner.describe())

    def fetch_manifest(self) -> bytes:
        data: bytes = self.inner.fetch_manifest()
        return data

    def size(self, path: str) -> int:
        return int(self.inner.size(path))

    def fetch_range(self, path: str, offset: int, length: int) -> bytes:
        data: bytes = self.inner.fetch_range(path, offset, length)
        with self._lock:
            self.bytes += len(data)
            self.requests += 1
        return data


def changed_copy(model: Path, dest: Path, fraction: float, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Copy `model` to `dest` with `fraction` of model.safetensors' whole data blocks changed
    (one float's lowest byte each: still a valid checkpoint); returns how many blocks changed."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model, dest)
    weights = dest / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        data_start = 8 + struct.unpack("<Q", fh.read(8))[0]
        first, last = -(-data_start // block_size), size // block_size - 1
        candidates = list(range(first, last + 1))
        if not candidates:
            raise ValueError(f"{weights}: no whole data block of {block_size} bytes to change; use a larger model")
        want = max(1, round(fraction * -(-size // block_size)))
        chosen = sorted({candidates[i * len(candidates) // want] for i in range(want)})
        for index in chosen:
            offset = index * block_size + 4 - (index * block_size - data_start) % 4
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ 0x01]))
    return len(chosen)


def _settle() -> None:
    """Untimed, before each timed step: the disk's writeback of what the step before left (the
    download's files, a removed cache: with ext4's ``discard`` the freed extents are trimmed at the
    next journal commit) is done now, so no step pays for another's."""
    os.sync()


def _raw_read(client: Any, bucket: str, keys: list[str]) -> tuple[int, float]:
    started = time.perf_counter()
    total = 0
    for key in keys:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        while chunk := body.read(8 * 2**20):
            total += len(chunk)
    return total, time.perf_counter() - started


def _ranged_read(source: Any, manifest: Any) -> tuple[int, float]:
    """The fill's own requests (one ranged GET per block, in order), bytes discarded: no hash, no disk."""
    started = time.perf_counter()
    total = sum(len(source.fetch_range(r.path, r.offset, r.length)) for r in manifest.block_refs())
    return total, time.perf_counter() - started


def _download(client: Any, bucket: str, keys: list[str], dest: Path) -> tuple[int, float]:
    """boto3's download_file of every object to local files (no fsync): a plain download to disk."""
    dest.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, key in enumerate(keys):
        client.download_file(bucket, key, str(dest / f"{i}"))
    elapsed = time.perf_counter() - started
    total = sum(f.stat().st_size for f in dest.iterdir())
    shutil.rmtree(dest, ignore_errors=True)
    return total, elapsed


def _fill(source: Any, root: Path) -> tuple[Any, float]:
    from warmpool_nodecache.fill import fill_revision
    from warmpool_nodecache.layout import CacheLayout

    started = time.perf_counter()
    result = fill_revision(CacheLayout(root), source)
    return result, time.perf_counter() - started


def _measure_rounds(rounds: int, client: Any, bucket: str, keys: list[str], manifest: Any,
                    config: Callable[[str], Any], work: Path,
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, float]]]:
    """Each round side by side: the raw read of the store, a ranged read and a plain download (context),
    and a fill into an empty cache; the last round's cache is left holding r1."""
    from warmpool_nodecache.s3 import S3Source

    total = manifest.total_bytes
    raw: list[dict[str, Any]] = []
    fills: list[dict[str, Any]] = []
    context: list[dict[str, float]] = []  # not judged: where the fill's time goes
    for round_ in range(rounds):
        _settle()
        read_bytes, read_s = _raw_read(client, bucket, keys)
        raw.append({"bytes": read_bytes, "seconds": read_s, "mib_s": read_bytes / read_s / 2**20})
        ranged_bytes, ranged_s = _ranged_read(S3Source(config("bench/r1"), client=client), manifest)
        context.append({"ranged_mib_s": ranged_bytes / ranged_s / 2**20})
        _settle()
        down_bytes, down_s = _download(client, bucket, keys, work / "download")
        context[-1]["download_mib_s"] = down_bytes / down_s / 2**20
        root = work / f"cache-{round_}"
        shutil.rmtree(root, ignore_errors=True)
        _settle()
        source = CountingSource(S3Source(config("bench/r1"), client=client))
        _, fill_s = _fill(source, root)
        fills.append({"bytes": source.bytes, "requests": source.requests, "seconds": fill_s,
                      "mib_s": total / fill_s / 2**20})
        _log(f"round {round_ + 1}: raw read {raw[-1]['mib_s']:.0f} MiB/s, fill {fills[-1]['mib_s']:.0f} MiB/s")
        if round_ < rounds - 1:
            shutil.rmtree(root, ignore_errors=True)
    return raw, fills, context


def run_cache(size: str, rounds: int, work_dir: Path | None = None,
              block_size: int = DEFAULT_BLOCK_SIZE, first_layer_rounds: int = 2,
              source_mib_s: float = 0.0) -> dict[str, Any]:
    """Run the benchmark (module docstring); `block_size` below the default only for the smoke test."""
    from warmpool_dev.paths import cache_root
    from warmpool_devcluster.seaweedfs import start_seaweedfs
    from warmpool_nodecache.manifest import build_manifest
    from warmpool_nodecache.push import push_model
    from warmpool_nodecache.s3 import S3Credentials, S3Source, S3SourceConfig, make_client

    from warmpool_bench.coldstart import find_model

    work = work_dir or Path(tempfile.mkdtemp(prefix="warmpool-bench-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    model = find_model(size, cache_root(), work / "model-work")
    weights_model = model.model_dir
    store = start_seaweedfs(work / "seaweedfs")
    result: dict[str, Any] = {"benchmark": "cache", "size": size, "rounds": rounds, "model": str(weights_model)}
    try:
        creds = S3Credentials(store.access_key_id, store.secret_access_key)

        def config(prefix: str) -> S3SourceConfig:
            return S3SourceConfig(store.endpoint, store.bucket, prefix, credentials=creds)

        client = make_client(config("bench/r1"))
        _log(f"pushing {weights_model} as r1 to {store.endpoint}")
        started = time.perf_counter()
        pushed = push_model(weights_model, config("bench/r1"), client=client, block_size=block_size)
        push_s = time.perf_counter() - started
        manifest = build_manifest(weights_model, block_size)
        total = manifest.total_bytes
        result.update(total_bytes=total, files=len(manifest.files), blocks=len(manifest.unique_blocks()),
                      block_size=manifest.block_size, push_s=push_s, digest=pushed.digest)
        changed = changed_copy(weights_model, work / "r2", CHANGED_FRACTION, block_size)
        push_model(work / "r2", config("bench/r2"), client=client, block_size=block_size)
        keys = [f"bench/r1/{f.path}" for f in manifest.files]

        raw, fills, context = _measure_rounds(rounds, client, store.bucket, keys, manifest, config, work)
        node = work / f"cache-{rounds - 1}"  # holds r1 now
        delta = CountingSource(S3Source(config("bench/r2"), client=client))
        _, delta_s = _fill(delta, node)
        held = CountingSource(S3Source(config("bench/r1"), client=client))
        held_result, _ = _fill(held, node)
        from warmpool_bench.cache_first_layer import run_first_layer

        first_layer = run_first_layer(lambda: S3Source(config("bench/r1"), client=client), weights_model, work,
                                      first_layer_rounds, source_mib_s) if first_layer_rounds else None
        raw_mib_s = statistics.median(r["mib_s"] for r in raw)
        fill_mib_s = statistics.median(f["mib_s"] for f in fills)
        download_mib_s = statistics.median(c["download_mib_s"] for c in context)
        vs_download = fill_mib_s / download_mib_s
        full_fill_bytes = fills[-1]["bytes"]
        result.update(
            raw=raw, fills=fills, context=context, raw_mib_s=raw_mib_s, fill_mib_s=fill_mib_s,
            download_mib_s=download_mib_s, fill_vs_raw=fill_mib_s / raw_mib_s, fill_vs_download=vs_download,
            delta={"changed_blocks": changed, "bytes": delta.bytes, "requests": delta.requests, "seconds": delta_s,
                   "ratio": delta.bytes / full_fill_bytes},
            held={"bytes": held.bytes, "requests": held.requests, "filled_here": held_result.filled_here,
                  "manifest_bytes": len(manifest.to_text())},
            targets={
                "fill_vs_download": {"target": f">= {TARGET_FILL_VS_DOWNLOAD:.0%}", "value": vs_download,
                                     "met": vs_download >= TARGET_FILL_VS_DOWNLOAD},
                "delta_bytes": {"target": f"<= {TARGET_DELTA_BYTES:.0%}", "value": delta.bytes / full_fill_bytes,
                                "met": delta.bytes / full_fill_bytes <= TARGET_DELTA_BYTES},
                "held_bytes": {"target": "0", "value": held.bytes, "met": held.bytes == 0},
                "first_layer": first_layer["target"] if first_layer else
                {"target": "<= 0.3x full fill", "value": None, "met": None, "note": "not run (0 rounds)"},
            },
            first_layer=first_layer,
        )
    finally:
        store.stop()
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def render_cache(result: dict[str, Any]) -> str:
    t = result["targets"]
    lines = [
        "# warmpool bench cache",
        "",
        f"Model: `{result['size']}` ({result['total_bytes'] / 1e9:.2f} GB, {result['files']} files, "
        f"{result['blocks']} blocks of {result['block_size'] / 2**20:g} MiB); store: SeaweedFS on 127.0.0.1 "
        f"(one `weed server`), {result['rounds']} alternating rounds. Push of r1: {result['push_s']:.1f} s.",
        "",
        "| target | measured | goal | verdict |",
        "|---|---|---|---|",
        _throughput_row(result),
        f"| 10 % changed revision: bytes / full fill | {t['delta_bytes']['value']:.1%} "
        f"({result['delta']['changed_blocks']} changed blocks, {result['delta']['bytes']} bytes) | "
        f"{t['delta_bytes']['target']} | {_verdict(t['delta_bytes']['met'])} |",
        f"| node holding the revision: block bytes downloaded | {t['held_bytes']['value']} (and the "
        f"{result['held']['manifest_bytes']}-byte manifest, read to learn the revision) | 0 | "
        f"{_verdict(t['held_bytes']['met'])} |",
        _first_layer_row(result),
        "",
        "Per round, in the order run (boto3's download_file of the same objects to files on the same disk, "
        "no fsync, is what the fill is judged against; the context columns are not judged: whole-object "
        "GETs and the fill's own ranged GETs, one at a time, bytes discarded):",
        "",
        "| round | download to disk MiB/s | fill MiB/s | fill / download | fill requests | "
        "context: raw read MiB/s | context: ranged GETs MiB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    context = result.get("context") or [{}] * len(result["raw"])
    for i, (raw, fill, ctx) in enumerate(zip(result["raw"], result["fills"], context, strict=True), 1):
        down = ctx.get("download_mib_s", float("nan"))
        lines.append(f"| {i} | {down:.0f} | {fill['mib_s']:.0f} | {fill['mib_s'] / down:.0%} | {fill['requests']} | "
                     f"{raw['mib_s']:.0f} | {ctx.get('ranged_mib_s', float('nan')):.0f} |")
    first = result.get("first_layer")
    if first:
        lines += [
            "",
            "Time to the worker's first layer, seconds from the start of the fill (the fill's order and the "
            f"worker's heat map put layer {first['hottest_layer']} first; a fresh cache and worker each run; "
            + (f"both fills through a {first['source_mib_s']:g} MiB/s link to the store; "
               if first.get("source_mib_s") else "the store at full loopback speed; ")
            + f"{first['bytes_before_first_layer']:.0%} of the revision's bytes come before that layer is whole: "
            "config, tokenizer, headers, the core tensors the engine loads first, the layer):",
            "",
            "| round | variant | first layer s | ready s | first completion s | fill s |",
            "|---|---|---|---|---|---|",
        ]
        for variant in ("full", "partial"):
            for i, run in enumerate(first["runs"][variant], 1):
                lines.append(f"| {i} | {variant} | {run['first_layer_s']:.2f} | {run['ready_s']:.2f} | "
                             f"{run['first_completion_s']:.2f} | {run['fill_s']:.2f} |")
    return "\n".join(lines) + "\n"


def _throughput_row(result: dict[str, Any]) -> str:
    t = result["targets"]
    if "fill_vs_download" not in t:  # a result from before the fill was judged against the download
        return (f"| fill throughput / raw read | {t['fill_vs_raw']['value']:.0%} ({result['fill_mib_s']:.0f} vs "
                f"{result['raw_mib_s']:.0f} MiB/s, medians) | {t['fill_vs_raw']['target']} | "
                f"{_verdict(t['fill_vs_raw']['met'])} |")
    target = t["fill_vs_download"]
    return (f"| fill throughput / boto3 download_file to disk | {target['value']:.0%} ({result['fill_mib_s']:.0f} vs "
            f"{result['download_mib_s']:.0f} MiB/s, medians; raw read {result['raw_mib_s']:.0f}) | "
            f"{target['target']} | {_verdict(target['met'])} |")


def _first_layer_row(result: dict[str, Any]) -> str:
    target = result["targets"]["first_layer"]
    first = result.get("first_layer")
    if not first:
        return f"| time to first layer, hot-first partial / full fill | - | {target['target']} | {_verdict(None)} |"
    full, partial = first["medians"]["full"], first["medians"]["partial"]
    return (f"| time to first layer, hot-first partial / full fill | {first['ratio']:.2f}x "
            f"({partial['first_layer_s']:.1f} vs {full['first_layer_s']:.1f} s, medians; ready "
            f"{partial['ready_s']:.1f} vs {full['ready_s']:.1f} s) | {target['target']} | {_verdict(target['met'])} |")
