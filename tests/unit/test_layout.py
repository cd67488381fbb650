"""The tree says which code runs where: product packages (in the images) never import the
developer tools or the tests, nothing finds files through its own location, no import
circle anywhere, and the images copy the product packages alone -- which import and run
without anything else beside them."""

from __future__ import annotations

import argparse
import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
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


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed once for every check here (each walks the same ~600 files; none changes the tree)."""
    return ast.parse(path.read_text())


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (lazy imports in functions too)."""
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
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


def test_one_kubernetes_client_in_the_product() -> None:
    """The operator and the node agent share one JSON client, error and configuration loader
    (warmpool/kube.py): no other product module defines a KubeError or loads a kubeconfig."""
    owners = {module for module, path in _modules(PRODUCT).items()
              if re.search(r"^class KubeError\b|load_incluster_config|new_client_from_config", path.read_text(), re.M)}
    assert owners == {"warmpool.kube"}, sorted(owners)


def test_one_lease_implementation_in_the_product() -> None:
    """Leader election and the node agent's fill and read Leases share warmpool/lease.py: no other
    product module reads or writes a Lease's holder or transitions."""
    owners = {module for module, path in _modules(PRODUCT).items()
              if re.search(r"holderIdentity|leaseTransitions", path.read_text())}
    assert owners == {"warmpool.lease"}, sorted(owners)


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


@pytest.mark.parametrize("dockerfile", ["operator/Dockerfile", "worker/Dockerfile"])
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
    runs = [[sys.executable, "-S", "-c", probe], [sys.executable, "-S", "-m", "warmpool", side, "--help"],
            [sys.executable, "-S", "-m", "warmpool", "demo"]]
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:  # independent: side by side
        loaded, command, demo = pool.map(lambda run: subprocess.run(run, env=env, cwd=tmp_path, capture_output=True,
                                                                    text=True, timeout=120), runs)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
    assert command.returncode == 0 and f"usage: warmpool {side}" in command.stdout, command.stderr
    assert demo.returncode == 2 and "a developer tool, not in this install" in demo.stderr, demo.stderr


# --------------------------------------------------------------------------- inside the operator

#: The operator's layers, each by what it may import of the operator (itself included).  The
#: layers below know nothing of those above: the API is what users write, the model the nouns
#: every layer shares, the rules pure decisions, io the world, control the pass, app the edge.
#: (api imports nothing of the operator at all: the model holds the parsed spec, so the model
#: imports the API, never the other way round.)  The activator is an edge of its own, beside app:
#: a separate process that shares the API's defaults, the names of the pool's children and pods
#: (rules: what the operator builds) and the list-and-watch with the operator.
OPERATOR_LAYERS: dict[str, frozenset[str]] = {
    "api": frozenset({"api"}),
    "model": frozenset({"api", "model"}),
    "rules": frozenset({"api", "model", "rules"}),
    "settings": frozenset({"api", "model", "rules", "settings"}),
    "io": frozenset({"api", "model", "rules", "io"}),
    "control": frozenset({"api", "model", "rules", "io", "settings", "control"}),
    "app": frozenset({"api", "model", "rules", "io", "settings", "control", "app"}),
    "activator": frozenset({"api", "rules", "io", "activator"}),
}


def _operator_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "warmpool_operator" and len(parts) > 1 else None


def test_the_operators_layers_import_only_the_layers_below_them() -> None:
    modules = {name: path for name, path in _modules(PRODUCT).items() if name.startswith("warmpool_operator")}
    layers = {layer for layer in map(_operator_layer, modules) if layer is not None}
    assert layers == set(OPERATOR_LAYERS), f"a layer the table does not name: {sorted(layers - set(OPERATOR_LAYERS))}"
    offenders = sorted(
        f"{module} ({layer}) imports {name}"
        for module, path in modules.items()
        if (layer := _operator_layer(module)) is not None
        for name in _imports(path)
        if (target := _operator_layer(name)) is not None and target in OPERATOR_LAYERS
        and target not in OPERATOR_LAYERS[layer]
    )
    assert not offenders, offenders


def _worker_part(module: str) -> str:
    """``builtin``, ``sidecar``, or ``shared`` (the worker's modules both commands use)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ("builtin", "sidecar") else "shared"


def test_the_workers_built_in_and_sidecar_parts_stand_apart() -> None:
    """The built-in engine's worker and the sidecar never import each other, and what they share
    imports neither; only the command line (cli, the edge) starts one or the other."""
    modules = {name: path for name, path in _modules(PRODUCT).items() if name.startswith("warmpool_worker")}
    assert {_worker_part(name) for name in modules} == {"builtin", "sidecar", "shared"}
    offenders = sorted(
        f"{module} ({part}) imports {name}"
        for module, path in modules.items()
        if module != "warmpool_worker.cli" and (part := _worker_part(module))
        for name in _imports(path)
        if name.startswith("warmpool_worker.") and (target := _worker_part(name)) != "shared" and target != part
    )
    assert not offenders, offenders


def test_the_api_model_does_not_import_the_forecasting_library() -> None:
    api = {name: path for name, path in _modules(PRODUCT).items() if name.startswith("warmpool_operator.api")}
    assert not [name for path in api.values() for name in _imports(path) if "forecast" in name]


#: The most lines a class and a function may have; past them a unit has more than
#: one job.  Declarative tables are named here as exceptions, each with what it declares.
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
SIZE_EXCEPTIONS = {
    "warmpool_worker.metrics.__init__": "the worker's metric families, one constructor call each",
}


def test_no_class_or_function_is_too_long() -> None:
    """The product's, the developer tools' and the GPU check's (tests are left out: a test is a story)."""
    too_long: list[str] = []
    scripts = {"gpu_check": REPO / "worker" / "gpu_check.py"}
    for module, path in (_modules(PRODUCT) | _modules(DEVELOPER) | scripts).items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit and f"{module}.{node.name}" not in SIZE_EXCEPTIONS:
                    too_long.append(f"{module}.{node.name}: {lines} lines (at most {limit})")
    assert not too_long, too_long


# --------------------------------------------------------------------------- module-level state

#: Product modules that still keep state at module level, and why; each is to go, none to come.
MUTABLE_STATE_EXCEPTIONS = {
    "warmpool_worker.builtin.engine.mapped_pages": "the libc handle, loaded on first use (the worker's phase)",
    "warmpool_worker.prefetch": "the libc handle, loaded on first use (the worker's phase)",
    "warmpool_nodecache.use": "a process-wide pin counter (the node cache's phase)",
}
#: Calls whose result is state that moves (a module-level one is module state), by qualified name.
STATEFUL_CALLS = frozenset({"itertools.count", "collections.deque", "collections.defaultdict", "collections.Counter"})


def _qualified(tree: ast.Module, called: str) -> str:
    """``count`` as ``itertools.count`` where the module imported it so."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == called:
                    return f"{node.module}.{alias.name}"
    return called


def _mutable_dataclasses(modules: dict[str, Path]) -> set[str]:
    """Names of the product's dataclasses that are not frozen (an instance of one is mutable)."""
    names: set[str] = set()
    for path in modules.values():
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                target = call.func if call is not None else decorator
                if ast.unparse(target) not in ("dataclass", "dataclasses.dataclass"):
                    continue
                frozen = call is not None and any(
                    k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in call.keywords)
                if not frozen:
                    names.add(node.name)
    return names


def _module_state(tree: ast.Module, mutable_classes: set[str]) -> list[str]:
    """Why a module holds state at module level: a ``global`` rebinding, a module-level instance
    of a mutable dataclass or of a stateful helper, or a write to another module's attribute."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                # NAME.attr = ... or module.NAME.attr = ...: a write into module-level state elsewhere.
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute | ast.Name) \
                        and ast.unparse(target.value).isupper():
                    found.append(f"line {node.lineno}: writes {ast.unparse(target)}")
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Call):
            called = ast.unparse(value.func)
            if called in mutable_classes or _qualified(tree, called) in STATEFUL_CALLS:
                found.append(f"line {node.lineno}: a module-level {called}(...)")
    return found


def test_no_product_module_keeps_mutable_state_at_module_level() -> None:
    """Settings travel as arguments (a frozen object built at the edge), never through module state."""
    modules = _modules(PRODUCT)
    mutable = _mutable_dataclasses(modules)
    offenders = {module: why for module, path in modules.items()
                 if (why := _module_state(_tree(path), mutable))}
    assert set(offenders) <= set(MUTABLE_STATE_EXCEPTIONS), {
        module: why for module, why in offenders.items() if module not in MUTABLE_STATE_EXCEPTIONS}
    assert set(MUTABLE_STATE_EXCEPTIONS) <= set(offenders), "an exception that no longer is one: drop it"


def test_the_state_check_sees_the_patterns_it_forbids() -> None:
    source = (
        "from dataclasses import dataclass\n@dataclass\nclass Config:\n    x: int = 0\n"
        "CONFIG = Config()\n"
        "def f():\n    global CONFIG\n    CONFIG.x = 1\n"
    )
    found = _module_state(ast.parse(source), {"Config"})
    assert len(found) == 3, found


# --------------------------------------------------------------------------- text that ages

#: An issue number in prose ("#15", "(#18)", "issue 14"): it means nothing to a reader outside the
#: tracker and goes stale when the issue closes.  Colours (#1f77b4) and anchors are not numbers.
ISSUE_NUMBER = re.compile(r"(?<![\w&/#])#\d{1,4}\b(?![0-9a-fA-F])|\bissues? #?\d+\b", re.IGNORECASE)
#: The text checked: the product's, and the developer tools' (their help, docs and rendered results).
PRODUCT_TEXT = ("warmpool", "operator", "worker", "nodecache", "helm", "docs", "README.md", "Makefile",
                "bench", "dev", "devcluster", "examples", "crds", ".ci")


def _product_text_files() -> list[Path]:
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", *PRODUCT_TEXT], capture_output=True, text=True,
                            check=True).stdout.split()
    return [REPO / name for name in listed
            if (REPO / name).is_file() and (REPO / name).suffix not in (".png", ".json", ".safetensors")]


def test_no_issue_numbers_in_the_projects_text() -> None:
    cited: dict[str, list[str]] = {}
    for path in _product_text_files():
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        hits = [f"{number}: {line.strip()[:80]}" for number, line in enumerate(lines, 1) if ISSUE_NUMBER.search(line)]
        if hits:
            cited[str(path.relative_to(REPO))] = hits
    assert not cited, cited


def test_the_warmpool_command_help_cites_no_issue_and_lists_every_benchmark() -> None:
    from warmpool_bench.cli import build_parser as bench_parser

    from warmpool import cli

    usage = cli._usage()
    assert not ISSUE_NUMBER.search(usage), usage
    commands = next(action for action in bench_parser()._actions if isinstance(action, argparse._SubParsersAction))
    bench_help = cli.SUBCOMMANDS["bench"][1]
    missing = [name for name in commands.choices if not re.search(rf"\b{re.escape(name)}\b", bench_help)]
    assert not missing, f"`warmpool --help` does not list: {missing}"


# --------------------------------------------------------------------------- assertions that can fail


def _tautologies(tree: ast.AST) -> list[str]:
    """Asserts no value can fail: a truthy constant, ``x in (True, False)``, ``x == x`` (no call),
    ``isinstance(x, object)`` and ``c or not c``."""
    found: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        test = node.test
        always = isinstance(test, ast.Constant) and bool(test.value)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            right = test.comparators[0]
            if isinstance(test.ops[0], ast.In) and isinstance(right, ast.Tuple | ast.List | ast.Set):
                always |= {ast.unparse(e) for e in right.elts} >= {"True", "False"}
            if isinstance(test.ops[0], ast.Eq | ast.Is | ast.LtE | ast.GtE):
                # Two calls may differ (a determinism check): only the same plain value is a tautology.
                calls = any(isinstance(n, ast.Call) for n in ast.walk(test))
                always |= not calls and ast.unparse(test.left) == ast.unparse(right)
        if isinstance(test, ast.Call) and ast.unparse(test.func) == "isinstance" and len(test.args) == 2:
            always |= ast.unparse(test.args[1]) == "object"
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
            said = {ast.unparse(value) for value in test.values}
            always |= any(f"not {value}" in said for value in said)
        if always:
            found.append(f"line {node.lineno}: assert {ast.unparse(test)[:80]}")
    return found


def test_no_test_asserts_what_cannot_fail() -> None:
    offenders = {str(path.relative_to(REPO)): found for path in sorted((REPO / "tests").rglob("*.py"))
                 if (found := _tautologies(_tree(path)))}
    assert not offenders, offenders


def test_the_tautology_check_sees_the_patterns_it_forbids() -> None:
    source = ("def t(met, x, c):\n    assert met in (True, False)\n    assert x == x\n    assert 1\n"
              "    assert isinstance(x, object)\n    assert c or not c\n    assert met in (True, None)\n"
              "    assert x == 1\n    assert f(x) == f(x)\n")
    assert [line.split(":")[0] for line in _tautologies(ast.parse(source))] == [
        "line 2", "line 3", "line 4", "line 5", "line 6"]
