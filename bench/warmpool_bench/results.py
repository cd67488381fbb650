"""A benchmark's results on disk: the raw JSON and its Markdown rendering, side by side.

Its own module so that every benchmark's command line (cli, predict_cli) writes results
the same way without importing another command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(result: dict[str, Any], out: Path, name: str, markdown: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path
