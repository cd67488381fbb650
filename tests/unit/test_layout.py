"""The tree says which code runs where: product packages (in the images) never import the
developer tools or the tests, nothing finds files through its own location, no import
circle anywhere, and the images copy the product packages alone -- which import and run
without anything else beside them."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
#: top-level package -> the folder it lives in
PRODUCT = {"warmpool": REPO, "warmpool_operator": REPO / "operator", "warmpool_worker": REPO / "worker",
           "warmpool_nodecache": REPO / "nodecache"}
DEVELOPER = {"warmpool_devcluster": REPO / "devcluster", "warmpool_bench": REPO / "bench", "warmpool_dev": REPO / "dev"}
TESTS = {"tests": REPO}
NOT_PRODUCT = ("warmpool_devcluster", "warmpool_bench", "warmpool_dev", "tests", "support")


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top, base in packages.items():
        for path in sorted((base / top).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (lazy imports in functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_product_packages_import_no_developer_or_test_module() -> None:
    offenders = {
        f"{module} imports {name}"
        for module, path in _modules(PRODUCT).items()
        for name in _imports(path)
        if name.split(".")[0] in NOT_PRODUCT
    }
    assert not offenders, sorted(offenders)


def test_no_product_module_finds_files_through_its_own_location() -> None:
    """`Path(__file__).parent...` works in a source checkout only, never after `pip install .`."""
    offenders = [str(path.relative_to(REPO)) for path in _modules(PRODUCT).values() if "__file__" in path.read_text()]
    assert not offenders, offenders


def test_no_import_circle_anywhere() -> None:
    modules = _modules({**PRODUCT, **DEVELOPER, **TESTS})

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {module: {t for t in map(resolve, _imports(path)) if t and t != module} for module, path in modules.items()}
    # Depth-first search for a back edge; the path to it is the circle.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 100 and not circles, circles


@pytest.mark.parametrize("dockerfile", ["operator/Dockerfile", "worker/Dockerfile", "worker/Dockerfile.cuda"])
def test_images_copy_the_product_packages_only(dockerfile: str) -> None:
    text = (REPO / dockerfile).read_text()
    sources = [part for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE) for part in line.split()[:-1]]
    assert sources, "no COPY from the build context"
    for source in sources:
        # nodecache/: the operator image also runs the chart's node-agent DaemonSet
        assert source.split("/")[0] in ("warmpool", "operator", "worker", "nodecache"), f"{dockerfile} copies {source}"
        assert not re.search(r"(^|/)(devcluster|dev|bench|tests)(/|$)|pyproject", source), f"{dockerfile}: {source}"
    ignore = (REPO / f"{dockerfile}.dockerignore").read_text()
    assert not re.search(r"^!(devcluster|dev|bench|tests|pyproject)", ignore, re.MULTILINE)


@pytest.mark.parametrize("side", ["operator", "worker"])
def test_an_images_packages_alone_import_and_run(side: str, tmp_path: Path) -> None:
    """What an image holds -- the shared core and one side, no source checkout, no dev package --
    imports every module and runs its command; a developer tool there says it is absent."""
    for top in ("warmpool", f"warmpool_{side}"):
        base = PRODUCT[top]
        shutil.copytree(base / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site processing, so the checkout's editable install (a .pth finder) is not there;
    # the installed third-party libraries come from site-packages on the path, after the copy.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), sysconfig.get_path("purelib")])}
    probe = (
        "import importlib, pkgutil, sys\n"
        f"for top in ('warmpool', 'warmpool_{side}'):\n"
        "    package = importlib.import_module(top)\n"
        "    for info in pkgutil.walk_packages(package.__path__, top + '.'):\n"
        "        if not info.name.endswith('__main__'):\n"
        "            importlib.import_module(info.name)\n"
        f"assert sys.modules['warmpool'].__file__.startswith({str(tmp_path)!r})\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {NOT_PRODUCT!r}))\n"
    )
    run = [sys.executable, "-S", "-c", probe]
    loaded = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
    command = subprocess.run([sys.executable, "-S", "-m", "warmpool", side, "--help"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 0 and f"usage: warmpool {side}" in command.stdout, command.stderr
    demo = subprocess.run([sys.executable, "-S", "-m", "warmpool", "demo"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode == 2 and "a developer tool, not in this install" in demo.stderr, demo.stderr
