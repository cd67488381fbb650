"""The runbook block convention (docs/runbooks/README.md) as tests/support/runbook_blocks.py parses
it, and the shipped pages kept to it (the run itself: tests/integration/test_runbooks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.runbook_blocks import (
    PLACEHOLDERS,
    Mark,
    RunbookFormatError,
    markdown_blocks,
    notes_commands,
    runbook_blocks,
    substitute,
    unknown_placeholders,
)

pytestmark = pytest.mark.unit

PAGE = """# A page
```sh
kubectl get wm <name> -n <model-namespace>
```
<!-- runbook: not-run: needs a Jaeger -->
```sh
curl "$JAEGER/api/traces"
```
```promql
up
```
<!-- runbook: teardown -->
```sh
helm uninstall <release> -n <namespace>
```
"""


def test_sh_blocks_with_their_marks_and_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    blocks = markdown_blocks(page)
    assert [(b.line, b.mark, b.reason) for b in blocks] == [
        (3, Mark.RUN, ""), (7, Mark.NOT_RUN, "needs a Jaeger"), (14, Mark.TEARDOWN, "")]
    assert blocks[0].needs_model() and not blocks[2].needs_model()
    values = {"name": "tiny", "model-namespace": "models"}
    assert substitute(blocks[0], values) == "kubectl get wm tiny -n models\n"


@pytest.mark.parametrize(("mark", "error"), [
    ("<!-- runbook: not-run -->", "needs its reason"),
    ("<!-- runbook: expect-fail -->", "needs its reason"),
    ("<!-- runbook: skip: why -->", "unknown runbook mark 'skip'"),
])
def test_a_mark_without_its_reason_or_unknown_is_refused(tmp_path: Path, mark: str, error: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{mark}\n```sh\nkubectl get wm -A\n```\n")
    with pytest.raises(RunbookFormatError, match=error):
        markdown_blocks(page)


def test_an_unclosed_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```sh\nkubectl get wm -A\n")
    with pytest.raises(RunbookFormatError, match="never closed"):
        markdown_blocks(page)


def test_a_placeholder_without_a_value_names_the_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("x\n```sh\nkubectl describe pod <pod> -n <model-namespace>\n```\n")
    (block,) = markdown_blocks(page)
    with pytest.raises(KeyError, match=r"page.md:3: no value for <pod>"):
        substitute(block, {"model-namespace": "models"})


def test_notes_commands_are_the_indented_kubectl_and_helm_lines(tmp_path: Path) -> None:
    notes = ("1. Check it:\n\n     kubectl -n ns rollout status deployment/warmpool\n"
             "     helm upgrade warmpool chart \\\n       --wait\nNot a command: kubectl\n")
    commands = notes_commands(notes, tmp_path / "NOTES.txt")
    assert [(c.line, c.text) for c in commands] == [
        (3, "kubectl -n ns rollout status deployment/warmpool\n"),
        (4, "helm upgrade warmpool chart \\\n--wait\n"),
    ]


def test_the_shipped_runbooks_keep_to_the_convention() -> None:
    """Every placeholder is one the README defines (parsing also refuses a bad mark), and the pages
    use no spelling the issue found wrong: `<release>-warmpool` (the chart names release `warmpool`'s
    objects `warmpool`), a hard-coded namespace, `auth can-i --list` (it proves nothing)."""
    blocks = runbook_blocks()
    assert blocks
    assert unknown_placeholders(blocks) == []
    wrong = [b.where for b in blocks
             if "<release>-warmpool" in b.text or "warmpool-system" in b.text or "can-i --list" in b.text]
    assert wrong == []
    assert {"release", "namespace", "fullname", "model-namespace", "name", "pod"} <= PLACEHOLDERS.keys()
