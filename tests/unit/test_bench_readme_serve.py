"""The commands in bench/README.md's `warmpool bench serve` section run as written: each
`warmpool bench` line parses with the bench's own parser and names only servers it knows, and
each `make` target exists and builds llama-server through `warmpool_bench.llama_server_build`
(`make -n`: printed, nothing run).  The run itself is the committed bench/results/serve-peer.*."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from warmpool_bench.cli import build_parser
from warmpool_bench.serve import SERVERS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SECTION = "## `warmpool bench serve`"


def _section_commands() -> list[str]:
    """The shell lines of the section's code blocks, continuation lines joined, comments dropped."""
    text = (REPO / "bench" / "README.md").read_text()
    assert SECTION in text, f"bench/README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    joined = "\n".join(block.split("\n", 1)[1] for block in blocks).replace("\\\n", " ")
    return [line.split("#", 1)[0].strip() for line in joined.splitlines() if line.split("#", 1)[0].strip()]


def test_the_sections_bench_commands_parse() -> None:
    commands = [c for c in _section_commands() if c.startswith("warmpool bench ")]
    assert commands, "no `warmpool bench` command in the serve section"
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[2:])
        assert args.command == "serve"
        assert set(args.servers) <= set(SERVERS), command


def test_the_sections_make_targets_build_llama_server() -> None:
    targets = [shlex.split(c)[1] for c in _section_commands() if c.startswith("make ")]
    assert targets == ["llama-server"]
    shown = subprocess.run(["make", "--no-print-directory", "-n", *targets], cwd=REPO, capture_output=True,
                           text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "-m warmpool_bench.llama_server_build" in shown.stdout
