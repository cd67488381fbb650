"""The worker's configuration objects: built once by the CLI, every value checked there,
an error naming the flag; nothing below the CLI sees an argparse namespace."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from warmpool_worker.cli import build_parser, main, serve_config, sidecar_config
from warmpool_worker.config import (
    ConfigError,
    GuardConfig,
    ListenConfig,
    ServeConfig,
    ServingLimits,
    SidecarConfig,
    WarmupConfig,
)
from warmpool_worker.guard import GuardState
from warmpool_worker.memory import MemoryReading
from warmpool_worker.metrics import ENGINE_KV_SOURCE, WorkerMetrics
from warmpool_worker.warmup import plan_for_tier

from warmpool.contract.api import DEFAULT_LENGTH_BUCKETS, Tier
from warmpool.tiering import Thresholds

pytestmark = pytest.mark.unit

WORKER_DIR = Path(__file__).resolve().parents[2] / "worker" / "warmpool_worker"
SERVE = ["serve", "--model", "/models/tiny"]
SIDECAR = ["sidecar", "--engine-url", "http://127.0.0.1:8000"]


def test_every_serve_flag_lands_in_its_field() -> None:
    args = build_parser().parse_args([
        *SERVE, "--host", "127.0.0.2", "--port", "0", "--device", "cuda:1", "--dtype", "bfloat16",
        "--model-name", "tiny", "--heat-map", "/h.json", "--prompts", "/p.json", "--buckets", "64,16",
        "--prompts-per-bucket", "3", "--decode-tokens", "5", "--tier-thresholds", "60,80,4",
        "--pause-at", "85", "--hot-layer-percent", "40", "--memory-capacity-bytes", "1024",
        "--memory-account-pid", "7", "--memory-account-pid", "9", "--guard-interval", "0.2",
        "--control-token-file", "/t", "--kv-prefix-dir", "/kv", "--max-queued-requests", "2",
        "--max-tokens-limit", "32", "--no-graph-capture", "--warmup-timeout", "30", "--threads", "2",
        "--cgroup-root", "/cg",
    ])
    assert serve_config(args) == ServeConfig(
        model=Path("/models/tiny"),
        model_name="tiny",
        device="cuda:1",
        dtype="bfloat16",
        heat_map=Path("/h.json"),
        kv_prefix_dir=Path("/kv"),
        graph_capture=False,
        threads=2,
        cgroup_root=Path("/cg"),
        listen=ListenConfig(host="127.0.0.2", port=0, control_token_file=Path("/t")),
        guard=GuardConfig(
            thresholds=Thresholds(truncate_at=60, pause_at=85, hysteresis=4),
            memory_capacity_bytes=1024,
            memory_account_pids=(7, 9),
            interval_s=0.2,
        ),
        warmup=WarmupConfig(
            buckets=(16, 64), prompts_per_bucket=3, decode_tokens=5, hot_layer_percent=40,
            prompts_file=Path("/p.json"), timeout_s=30,
        ),
        limits=ServingLimits(max_queued_requests=2, max_tokens_limit=32),
    )


def test_every_sidecar_flag_lands_in_its_field() -> None:
    args = build_parser().parse_args([
        *SIDECAR, "--model-dir", "/m", "--health-path", "/healthz", "--engine-metrics-path", "/m2",
        "--served-model-name", "m", "--api-key-file", "/k", "--max-context", "2048", "--host", "127.0.0.3",
        "--port", "9000", "--device", "cpu", "--heat-map", "/h.json", "--buckets", "8", "--chars-per-token", "3",
        "--memory-source", "engine-kv", "--no-prefetch", "--prefetch-mode", "advise", "--poll-interval", "0.1",
        "--lost-after", "4", "--probe-timeout", "1.5", "--request-timeout", "9", "--retries", "0",
        "--retry-backoff", "0", "--warmup-timeout", "20", "--guard-interval", "0.3",
    ])
    config = sidecar_config(args)
    assert config == SidecarConfig(
        engine_url="http://127.0.0.1:8000",
        model_dir=Path("/m"),
        health_path="/healthz",
        engine_metrics_path="/m2",
        served_model_name="m",
        api_key_file=Path("/k"),
        max_context=2048,
        device="cpu",
        heat_map=Path("/h.json"),
        chars_per_token=3.0,
        memory_source="engine-kv",
        prefetch=False,
        prefetch_mode="advise",
        poll_interval_s=0.1,
        lost_after=4,
        probe_timeout_s=1.5,
        request_timeout_s=9.0,
        retries=0,
        retry_backoff_s=0.0,
        listen=ListenConfig(host="127.0.0.3", port=9000),
        guard=GuardConfig(interval_s=0.3),
        warmup=WarmupConfig(buckets=(8,), timeout_s=20),
    )


def test_defaults_of_the_flags_are_the_defaults_of_the_objects() -> None:
    """One set of defaults: a bare command line builds what the objects' own defaults build."""
    serve = serve_config(build_parser().parse_args([*SERVE, "--host", "127.0.0.1"]))
    assert serve == ServeConfig(model=Path("/models/tiny"))
    sidecar = sidecar_config(build_parser().parse_args([*SIDECAR, "--host", "127.0.0.1"]))
    assert sidecar == SidecarConfig(engine_url="http://127.0.0.1:8000")
    assert serve.warmup.buckets == DEFAULT_LENGTH_BUCKETS


@pytest.mark.parametrize(("argv", "flag"), [
    ([*SERVE, "--guard-interval", "0"], "--guard-interval"),
    ([*SERVE, "--guard-interval", "nan"], "--guard-interval"),
    ([*SERVE, "--warmup-timeout", "-1"], "--warmup-timeout"),
    ([*SERVE, "--prompts-per-bucket", "0"], "--prompts-per-bucket"),
    ([*SERVE, "--decode-tokens", "-2"], "--decode-tokens"),
    ([*SERVE, "--hot-layer-percent", "101"], "--hot-layer-percent"),
    ([*SERVE, "--memory-capacity-bytes", "0"], "--memory-capacity-bytes"),
    ([*SERVE, "--memory-account-pid", "-5"], "--memory-account-pid"),
    ([*SERVE, "--max-queued-requests", "0"], "--max-queued-requests"),
    ([*SERVE, "--max-tokens-limit", "0"], "--max-tokens-limit"),
    ([*SERVE, "--threads", "0"], "--threads"),
    ([*SERVE, "--port", "70000"], "--port"),
    ([*SERVE, "--device", "mps"], "--device"),
    ([*SERVE, "--truncate-at", "95"], "--truncate-at"),
    ([*SERVE, "--tier-thresholds", "90,70"], "--tier-thresholds"),
    ([*SERVE, "--buckets", "0,32"], "--buckets"),
    ([*SIDECAR[:1], "--engine-url", "ftp://127.0.0.1"], "--engine-url"),
    ([*SIDECAR[:1], "--engine-url", "127.0.0.1:8000"], "--engine-url"),
    ([*SIDECAR, "--health-path", "health"], "--health-path"),
    ([*SIDECAR, "--poll-interval", "0"], "--poll-interval"),
    ([*SIDECAR, "--lost-after", "0"], "--lost-after"),
    ([*SIDECAR, "--probe-timeout", "0"], "--probe-timeout"),
    ([*SIDECAR, "--request-timeout", "-1"], "--request-timeout"),
    ([*SIDECAR, "--retries", "-1"], "--retries"),
    ([*SIDECAR, "--retry-backoff", "-0.5"], "--retry-backoff"),
    ([*SIDECAR, "--chars-per-token", "0"], "--chars-per-token"),
    ([*SIDECAR, "--max-context", "0"], "--max-context"),
])
def test_a_bad_value_stops_the_command_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_objects_check_themselves_and_are_frozen() -> None:
    with pytest.raises(ConfigError, match="--prompts-per-bucket"):
        WarmupConfig(prompts_per_bucket=0)
    with pytest.raises(ConfigError, match="--buckets"):
        WarmupConfig(buckets=(128, 32))  # not shortest first
    with pytest.raises(ConfigError, match="--max-tokens-limit"):
        ServingLimits(max_tokens_limit=0)
    config = ServeConfig(model=Path("/models/tiny"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cpu"  # type: ignore[misc]
    assert config.served_name == "tiny"


def test_the_plan_comes_from_the_warmup_config() -> None:
    warmup = WarmupConfig(buckets=(16, 64, 256), prompts_per_bucket=3, decode_tokens=2, hot_layer_percent=50)
    full = plan_for_tier(Tier.FULL, warmup, [3, 1, 0, 2], max_context=100)
    assert (full.buckets, full.prompts_per_bucket, full.decode_tokens) == ((16, 64, 98), 3, 2)
    truncated = plan_for_tier(Tier.TRUNCATED, warmup, [3, 1, 0, 2], max_context=None)
    assert (truncated.buckets, truncated.resident_layers) == ((16,), (3, 1))


def test_the_guard_update_is_published_once_for_both_modes() -> None:
    """Bytes readings export bytes and ratio; the sidecar's engine-KV reading (a ratio) only the ratio."""
    metrics = WorkerMetrics(process_start=0.0)
    bytes_reading = MemoryReading(600, 1000, "cgroup")
    metrics.publish_guard(GuardState(Tier.FULL, Tier.FULL, None, None, bytes_reading))
    text = metrics.render().decode()
    assert 'warmpool_accelerator_memory_used_bytes{source="cgroup"} 600.0' in text
    kv = MemoryReading(950_000, 1_000_000, ENGINE_KV_SOURCE)
    metrics.publish_guard(GuardState(Tier.PAUSED, Tier.PAUSED, None, None, kv))
    text = metrics.render().decode()
    assert f'warmpool_accelerator_memory_used_ratio{{source="{ENGINE_KV_SOURCE}"}} 0.95' in text
    assert "warmpool_accelerator_memory_used_bytes{" not in text  # a ratio is not bytes
    assert 'warmpool_tier{tier="paused"} 1.0' in text


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def test_nothing_below_the_cli_imports_it_or_argparse() -> None:
    """The cli <-> runtime circle is gone, and argparse stays at the edge."""
    for path in sorted(WORKER_DIR.rglob("*.py")):
        if path.name == "cli.py":
            continue
        imported = _imported_modules(path)
        assert "warmpool_worker.cli" not in imported, path.name
        assert "argparse" not in imported, path.name


def test_help_imports_nothing_heavy() -> None:
    """`--help` (and argument errors) run before aiohttp, torch or the config dataclasses load."""
    probe = (
        "import sys\n"
        "from warmpool_worker.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('aiohttp', 'torch', 'prometheus_client', 'dataclasses', 'warmpool_worker.config')\n"
        "print('loaded:' + ','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert "usage: warmpool worker serve" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "loaded:"


def test_partial_cache_is_off_by_default_and_its_timeout_is_checked() -> None:
    from warmpool_worker.partial_cache import PartialCacheConfig

    assert serve_config(build_parser().parse_args(SERVE)).partial_cache is None
    on = serve_config(build_parser().parse_args([*SERVE, "--partial-cache", "--partial-cache-timeout", "30"]))
    assert on.partial_cache == PartialCacheConfig(timeout_s=30.0)
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--partial-cache-timeout"):
            serve_config(build_parser().parse_args([*SERVE, "--partial-cache", "--partial-cache-timeout", bad]))


def _options(command: str) -> set[str]:
    """Every option string ``warmpool worker <command>`` accepts."""
    sub = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return {option for action in sub.choices[command]._actions for option in action.option_strings}


def test_the_flags_both_commands_take_are_declared_once() -> None:
    """The shared flags come from one parent parser: a flag both commands accept is declared in it,
    never once per command, and each flag appears once in the CLI's source."""
    from warmpool_worker import cli

    shared = {option for action in cli._shared_flags()._actions for option in action.option_strings}
    assert _options("serve") & _options("sidecar") == shared | {"-h", "--help"}
    assert len(shared) >= 21
    source = Path(cli.__file__).read_text()
    twice = sorted(flag for flag in _options("serve") | _options("sidecar")
                   if flag.startswith("--") and source.count(f'"{flag}"') > 1)
    assert not twice, twice
