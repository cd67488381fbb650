"""What each container image installs runs what the chart starts from it.

The images pin their whole dependency closure in a requirements file and copy the product
packages in (see each Dockerfile).  Features added later (the demand forecaster's numpy and
LightGBM, OpenTelemetry, the node agent and boto3) once went into the code and the extras but
not into those files, and nothing noticed: an operator image that could not start.  Two checks:

* every third-party module the image's packages import (at the top of a module or inside a
  function; not ``if TYPE_CHECKING:`` imports) belongs to a distribution the image pins, and
  every requirement of the extras the image serves is pinned at a version the extra allows:
  for all three images, read statically;
* the operator image, built the way its Dockerfile builds it (no Docker engine here): a fresh
  virtualenv, ``pip install --no-deps`` of the pinned file from PyPI, ``pip check``, the
  product packages copied in as its ``COPY`` lines say, then each command the chart runs from
  that image (``warmpool operator``, ``warmpool node-agent``) started, every module of those
  packages imported, and the lazily imported parts used for real: a LightGBM quantile model
  trained, an OTLP span exporter made, an S3 client made.  The worker images are not installed here (torch
  is gigabytes); the static check covers them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(requirements: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in requirements.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            out[_normal(name)] = version
    return out


def _copied_packages(dockerfile: Path) -> dict[str, str]:
    """The product packages a Dockerfile copies: source directory -> package name."""
    found = re.findall(r"^COPY (\S+)/ /src/(warmpool\w*)/$", dockerfile.read_text(), re.MULTILINE)
    assert found, f"{dockerfile}: no product package copied"
    return {src: package for src, package in found}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _third_party_imports(package_dir: Path) -> dict[str, str]:
    """Top-level third-party module -> one file that imports it."""
    out: dict[str, str] = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top.startswith("warmpool") or top == "__future__":
                    continue
                out.setdefault(top, str(path.relative_to(REPO)))
    return out


#: image -> (its Dockerfile, its requirements file, the pyproject extras it serves)
IMAGES = {
    "operator": (REPO / "operator" / "Dockerfile", REPO / "operator" / "image-requirements.txt",
                 ("operator", "node-agent", "nodecache")),
    "worker-cpu": (REPO / "worker" / "Dockerfile", REPO / "worker" / "image-requirements.txt", ("worker",)),
    "worker-cuda": (REPO / "worker" / "Dockerfile.cuda", REPO / "worker" / "image-requirements-cuda.txt",
                    ("worker",)),
}


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_pins_every_distribution_its_code_imports(image: str) -> None:
    dockerfile, requirements, extras = IMAGES[image]
    pins = _pins(requirements)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project.get("dependencies", [])]
    wanted += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    problems = []
    for requirement in wanted:
        pinned = pins.get(_normal(requirement.name))
        if pinned is None:
            problems.append(f"{requirement} (an extra this image serves) is not pinned")
        elif not requirement.specifier.contains(pinned.split("+")[0], prereleases=True):
            problems.append(f"{requirement.name}=={pinned} is outside {requirement}")
    # Module -> distributions, from this environment (which installs every extra).
    providers = importlib.metadata.packages_distributions()
    for source in _copied_packages(dockerfile):
        for module, where in _third_party_imports(REPO / source).items():
            dists = {_normal(d) for d in providers.get(module, [])}
            assert dists, f"{where} imports {module}, which no installed distribution provides"
            if not dists & set(pins):
                problems.append(f"{where} imports {module} ({', '.join(sorted(dists))}), not pinned")
    assert not problems, f"{requirements.relative_to(REPO)}:\n" + "\n".join(problems)


#: Run in the image's virtualenv: every module of the product packages imported (a module the
#: operator imports at start, such as the forecaster's, fails here, not in a cluster), then the
#: lazily imported parts, each made to do real work.
LAZY_PARTS = """
import importlib, pkgutil, sys
for package in sys.argv[1:]:
    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not module.name.endswith(".__main__"):  # the command line itself, which would run
            importlib.import_module(module.name)

import numpy as np
from warmpool_operator.predict import quantile_model
from warmpool_operator import tracing
from warmpool_nodecache import s3
import lightgbm, boto3
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

rng = np.random.default_rng(0)
x = rng.normal(size=(200, 3))
y = x[:, 0] * 2 + rng.normal(size=200)
booster = lightgbm.train({"objective": "quantile", "alpha": 0.9, "verbose": -1, "num_threads": 1},
                         lightgbm.Dataset(x, label=y), num_boost_round=5)
assert booster.predict(x[:4]).shape == (4,)
OTLPSpanExporter(endpoint="http://127.0.0.1:1/v1/traces")  # made, never sent to
boto3.session.Session().client("s3", endpoint_url="http://127.0.0.1:1", region_name="us-east-1",
                                aws_access_key_id="x", aws_secret_access_key="y")
print("lazy parts ok", quantile_model.__name__, tracing.__name__, s3.__name__)
"""


def test_operator_image_runs_what_the_chart_starts_from_it(tmp_path: Path) -> None:
    dockerfile, requirements, _ = IMAGES["operator"]
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=180)
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(*args: str | Path, timeout: float = 120) -> str:
        proc = subprocess.run([str(a) for a in args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)
        command = " ".join(map(str, args))
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    # As the Dockerfile: exactly the pinned closure, nothing resolved, then pip's own check.
    run(pip, "install", "--no-deps", "--require-virtualenv", "--progress-bar", "off", "-r", requirements, timeout=900)
    run(pip, "check")
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    for source, package in _copied_packages(dockerfile).items():
        shutil.copytree(REPO / source, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    warmpool = ["-c", "import sys; from warmpool.cli import main; sys.exit(main())"]
    # The chart's commands from this image (helm/warmpool/templates: deployment.yaml, node-agent.yaml).
    assert "--all-namespaces" in run(python, *warmpool, "operator", "--help")
    assert "--cache-root" in run(python, *warmpool, "node-agent", "--help")
    assert "lazy parts ok" in run(python, "-c", LAZY_PARTS, *_copied_packages(dockerfile).values())
