"""The runnable commands of the runbooks and of the chart's NOTES.txt, as docs/runbooks/README.md
("Commands in these pages run") defines them: which blocks run, their marks, their placeholders.

Parsing only; tests/integration/test_runbooks.py runs them against a real release.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"

#: The placeholders a block may use, each with what it stands for (the README's table).
PLACEHOLDERS: Mapping[str, str] = {
    "release": "the Helm release name",
    "namespace": "the release's namespace",
    "fullname": "the chart's name for the release's objects",
    "model-namespace": "a watched namespace holding the WarmModel",
    "name": "a WarmModel",
    "pod": "one of the WarmModel's worker pods",
    "node": "the node that pod runs on",
    "claim": "the model's PersistentVolumeClaim",
    "path": "the model's folder in the claim",
    "chart": "the chart",
    "values-file": "the release's values file",
    "revision": "a revision of the release",
}
#: Placeholders that need a WarmModel (it, its pods, its claim) to stand for something; every
#: install has a watched <model-namespace>, only one has a WarmModel in it.
MODEL_PLACEHOLDERS = frozenset({"name", "pod", "node", "claim", "path"})

_PLACEHOLDER = re.compile(r"<([a-z][a-z-]*)>")
_FENCE_OPEN = re.compile(r"^```sh\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")
_MARK = re.compile(r"^<!--\s*runbook:\s*(?P<kind>[a-z-]+)\s*(?::\s*(?P<why>.*?))?\s*-->\s*$")
#: A NOTES.txt command: an indented line that starts with kubectl or helm.
_NOTES_COMMAND = re.compile(r"^\s+(?:kubectl|helm)\s")


class Mark(enum.Enum):
    RUN = "run"
    EXPECT_FAIL = "expect-fail"
    TEARDOWN = "teardown"
    NOT_RUN = "not-run"


#: Marks that must say why.
_NEEDS_REASON = frozenset({Mark.EXPECT_FAIL, Mark.NOT_RUN})


class RunbookFormatError(ValueError):
    """A page breaks the convention (an unknown mark, a mark without its reason, an unclosed fence)."""


@dataclass(frozen=True)
class Block:
    """One runnable block: where it is (``line``: the file's line of the block's first command)."""

    source: Path
    line: int
    text: str
    mark: Mark = Mark.RUN
    reason: str = ""

    @property
    def where(self) -> str:
        try:
            shown = self.source.relative_to(REPO)
        except ValueError:
            shown = self.source
        return f"{shown}:{self.line}"

    def placeholders(self) -> frozenset[str]:
        return frozenset(_PLACEHOLDER.findall(self.text))

    def needs_model(self) -> bool:
        return bool(self.placeholders() & MODEL_PLACEHOLDERS)


def _mark_of(line: str, where: str) -> tuple[Mark, str] | None:
    found = _MARK.match(line.strip())
    if found is None:
        return None
    try:
        mark = Mark(found["kind"])
    except ValueError:
        known = ", ".join(m.value for m in Mark if m is not Mark.RUN)
        raise RunbookFormatError(f"{where}: unknown runbook mark {found['kind']!r} (known: {known})") from None
    reason = (found["why"] or "").strip()
    if mark in _NEEDS_REASON and not reason:
        raise RunbookFormatError(
            f"{where}: the mark {mark.value!r} needs its reason: <!-- runbook: {mark.value}: why -->")
    return mark, reason


def markdown_blocks(path: Path) -> list[Block]:
    """The ```sh blocks of one Markdown page, each with the mark on the line above its fence."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        if not _FENCE_OPEN.match(lines[index]):
            index += 1
            continue
        opened = index
        mark = _mark_of(lines[opened - 1], f"{path}:{opened}") if opened > 0 else None
        body: list[str] = []
        index += 1
        while index < len(lines) and not _FENCE_CLOSE.match(lines[index]):
            body.append(lines[index])
            index += 1
        if index == len(lines):
            raise RunbookFormatError(f"{path}:{opened + 1}: a ```sh block is never closed")
        kind, reason = mark or (Mark.RUN, "")
        blocks.append(Block(path, opened + 2, "\n".join(body) + "\n", kind, reason))
        index += 1
    return blocks


def runbook_blocks(folder: Path = RUNBOOKS) -> list[Block]:
    """Every ```sh block of every page in ``folder``, pages in name order."""
    return [block for page in sorted(folder.glob("*.md")) for block in markdown_blocks(page)]


def notes_commands(text: str, source: Path) -> list[Block]:
    """The commands of a rendered NOTES.txt (one block per command; a trailing backslash continues it)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        if not _NOTES_COMMAND.match(lines[index]):
            index += 1
            continue
        first = index
        command = [lines[index].strip()]
        while command[-1].endswith("\\") and index + 1 < len(lines):
            index += 1
            command.append(lines[index].strip())
        blocks.append(Block(source, first + 1, "\n".join(command) + "\n"))
        index += 1
    return blocks


def unknown_placeholders(blocks: Iterable[Block]) -> list[str]:
    """``file:line: <x>`` for each placeholder the convention does not define."""
    return [f"{block.where}: <{name}>" for block in blocks
            for name in sorted(block.placeholders()) if name not in PLACEHOLDERS]


def substitute(block: Block, values: Mapping[str, str]) -> str:
    """The block's text with each placeholder replaced; a placeholder without a value is an error."""
    missing = sorted(block.placeholders() - values.keys())
    if missing:
        raise KeyError(f"{block.where}: no value for {', '.join(f'<{m}>' for m in missing)}")
    return _PLACEHOLDER.sub(lambda found: values[found[1]], block.text)
