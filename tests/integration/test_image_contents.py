"""What each container image installs runs what the chart starts from it.

The images pin their whole dependency closure in a requirements file and copy the product
packages in (see each Dockerfile).  Features added later (the demand forecaster's numpy and
LightGBM, OpenTelemetry, the node agent and boto3) once went into the code and the extras but
not into those files, and nothing noticed: an operator image that could not start.  Two checks:

* every third-party module the image's packages import (at the top of a module or inside a
  function; not ``if TYPE_CHECKING:`` imports) belongs to a distribution the image pins, and
  every requirement of the extras the image serves is pinned at a version the extra allows:
  for all three images, read statically;
* the images as `warmpool images build` built them from their Dockerfiles, each run in a pod on
  the real node: each command the chart runs from that image (``warmpool operator``,
  ``warmpool node-agent``, ``warmpool worker serve|sidecar``) started, every module of those
  packages imported, and the lazily imported parts used for real: a LightGBM quantile model
  trained, an OTLP span exporter made, an S3 client made, a torch tensor summed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from warmpool_devcluster.testing import ClusterHandle

from tests.support.e2e import run_pod

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
    found = re.findall(r"^COPY (\S+)/ /opt/warmpool/app/(warmpool\w*)/$", dockerfile.read_text(), re.MULTILINE)
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
    "worker": (REPO / "worker" / "Dockerfile", REPO / "worker" / "image-requirements.txt", ("worker",)),
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
from warmpool_operator.rules.forecast import quantile_model
from warmpool_operator.io import tracing
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


def test_each_image_runs_what_the_chart_starts_from_it(cluster: ClusterHandle, namespace: str) -> None:
    """The images as built here, each in a pod on the real node, as the chart runs them (UID 65532,
    read-only root filesystem): the commands the chart starts answer, every module of the product
    packages imports, the lazily imported parts do real work, and no installer is left in them."""
    if not cluster.images:
        pytest.skip("an external cluster: its images are not this checkout's")
    probe = "; ".join([
        "set -e", "warmpool operator --help > /dev/null", "warmpool node-agent --help > /dev/null",
        f"python -c {shlex.quote(LAZY_PARTS)} {' '.join(_copied_packages(IMAGES['operator'][0]).values())}",
        "! python -c 'import pip' 2> /dev/null", "echo operator-image-ok"])
    phase, log = run_pod(cluster, namespace, "operator-image", cluster.images["operator"], ["sh", "-c", probe])
    assert phase == "Succeeded" and "lazy parts ok" in log and "operator-image-ok" in log, log
    probe = "; ".join([
        "set -e", "warmpool worker serve --help > /dev/null", "warmpool worker sidecar --help > /dev/null",
        "python -c 'import torch, safetensors, tokenizers; "
        "print(\"torch\", torch.__version__, torch.ones(2).sum().item())'",
        "! python -c 'import pip' 2> /dev/null", "echo worker-image-ok"])
    phase, log = run_pod(cluster, namespace, "worker-image", cluster.images["worker"], ["sh", "-c", probe])
    assert phase == "Succeeded" and "torch 2." in log and "2.0" in log and "worker-image-ok" in log, log
