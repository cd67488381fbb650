"""The command line a newcomer meets: `warmpool version`, `warmpool model --help` naming `push`,
`--log-level` taking only its choices on every command, `bench render` and the operator failing
in one line (no traceback), and one flag name per setting (`--health-port`; the operator's old
`--liveness-port` still works, hidden and deprecated)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from warmpool_nodecache import agent_cli
from warmpool_operator.activator import app as activator_app
from warmpool_operator.app import cli as operator_cli
from warmpool_worker import cli as worker_cli

from warmpool import __version__
from warmpool import cli as warmpool_cli
from warmpool.contract.telemetry import LOG_LEVELS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _warmpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "warmpool", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def _warmpool_each(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Independent `warmpool` commands side by side (each a second of interpreter start), in order."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda args: _warmpool(*args), commands))


def test_warmpool_version_and_the_usage_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert warmpool_cli.main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    assert warmpool_cli.main(["--help"]) == 0
    assert any(line.split()[:1] == ["version"] for line in capsys.readouterr().out.splitlines())


def test_model_help_lists_push_beside_fetch() -> None:
    shown = _warmpool("model", "--help")
    assert shown.returncode == 0
    assert "{push,fetch}" in shown.stdout and "a model directory to an S3 store" in shown.stdout
    # and `push` is still the push command's own parser
    push = _warmpool("model", "push", "--help")
    assert push.returncode == 0 and "--endpoint" in push.stdout


#: Every command with --log-level: (name, a parse of its minimal valid arguments plus ours).
PARSERS: dict[str, Callable[[list[str]], argparse.Namespace]] = {
    "operator": lambda extra: operator_cli.build_parser().parse_args(["-n", "ns", *extra]),
    "activator": lambda extra: activator_app.build_parser().parse_args(["-n", "ns", *extra]),
    "worker serve": lambda extra: worker_cli.build_parser().parse_args(["serve", "--model", "/m", *extra]),
    "worker sidecar": lambda extra: worker_cli.build_parser().parse_args(
        ["sidecar", "--engine-url", "http://127.0.0.1:1", *extra]),
    "node-agent": lambda extra: agent_cli.build_parser().parse_args(extra),
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_log_level_takes_only_its_choices(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parse = PARSERS[command]
    assert parse([]).log_level == "INFO"
    assert parse(["--log-level", "debug"]).log_level == "DEBUG"  # any case, as the chart's values
    for level in LOG_LEVELS:
        assert parse(["--log-level", level]).log_level == level
    with pytest.raises(SystemExit) as exited:
        parse(["--log-level", "VERBOSE"])
    assert exited.value.code == 2
    assert "argument --log-level: invalid choice: 'VERBOSE'" in capsys.readouterr().err


def _one_line_error(result: subprocess.CompletedProcess[str], rc: int, *phrases: str) -> None:
    assert result.returncode == rc, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0]


def test_bench_render_names_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "garbage.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "unknown.json").write_text(json.dumps({"benchmark": "nope"}))
    (tmp_path / "partial.json").write_text(json.dumps({"benchmark": "coldstart"}))
    expected = {"missing": "missing.json: No such file or directory", "garbage": "is not a results file",
                "list": "a JSON object, this one a list", "unknown": "'nope', not one of",
                "partial": "is not a complete coldstart results file"}
    results = _warmpool_each(*(("bench", "render", str(tmp_path / f"{name}.json")) for name in expected))
    for result, phrase in zip(results, expected.values(), strict=True):
        _one_line_error(result, 1, phrase)
    assert not (tmp_path / "partial.md").exists()


def test_bench_render_renders_every_kind_of_results_file_the_repository_holds(tmp_path: Path) -> None:
    """`zero` once fell through to the scale renderer and died of a KeyError.  `predict-live`: a full
    three-policy live run (the live smoke test runs two policies, to stay short)."""
    copies = [tmp_path / f"{name}.json" for name in ("zero", "scale", "wake", "predict-live")]
    for copy in copies:
        copy.write_text((REPO / "bench" / "results" / copy.name).read_text())
    for copy, result in zip(copies, _warmpool_each(*(("bench", "render", str(copy)) for copy in copies)), strict=True):
        assert result.returncode == 0, result.stderr
        assert copy.with_suffix(".md").read_text().startswith("# ")


def test_the_operator_without_a_kubeconfig_says_so_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    result = _warmpool("operator", "--namespace", "ns", env=env)
    _one_line_error(result, 1, "warmpool operator: no Kubernetes credentials", "set KUBECONFIG")
    env["KUBECONFIG"] = str(tmp_path / "absent")
    _one_line_error(_warmpool("operator", "--namespace", "ns", env=env), 1, f"names no file ({tmp_path}/absent)")


def test_a_kubeconfig_or_a_service_account_is_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert operator_cli.missing_credentials() is not None
    (tmp_path / "kc").write_text("apiVersion: v1\n")
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(tmp_path / "none"), str(tmp_path / "kc")]))
    assert operator_cli.missing_credentials() is None


def test_one_name_for_the_health_port_and_the_old_one_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    parser = operator_cli.build_parser()
    assert parser.parse_args(["-n", "ns"]).health_port == operator_cli.DEFAULT_OPERATOR_HEALTH_PORT
    assert parser.parse_args(["-n", "ns", "--health-port", "9001"]).health_port == 9001
    capsys.readouterr()
    assert parser.parse_args(["-n", "ns", "--liveness-port", "0"]).health_port == 0
    assert "--liveness-port is deprecated, use --health-port" in capsys.readouterr().err
    assert "--liveness-port" not in parser.format_help() and "--health-port" in parser.format_help()
    # The activator and the node agent name it the same.
    assert activator_app.build_parser().parse_args(["-n", "ns", "--health-port", "1"]).health_port == 1
    assert agent_cli.build_parser().parse_args(["--health-port", "1"]).health_port == 1
    template = (REPO / "helm" / "warmpool" / "templates" / "deployment.yaml").read_text()
    assert "--health-port={{ .Values.operator.healthPort }}" in template and "--liveness-port" not in template
