"""Each `helm install` the README gives renders: the same arguments through `helm template` (no
cluster), its placeholders filled.  The chart requires image names (it names none, as warmpool
publishes none), so a README command that forgot them fails here, not on a user's cluster."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from warmpool_devcluster import build

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: The README's placeholders, filled as a user would.
PLACEHOLDERS = {"OPERATOR_TAG": "0123abcd", "WORKER_TAG": "4567ef01"}
#: Arguments that need a cluster (`helm template` has no use for them).
CLUSTER_ONLY = {"--wait", "--create-namespace"}


def _readme_helm_installs() -> list[list[str]]:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        commands += [shlex.split(line, comments=True) for line in joined.splitlines()
                     if line.strip().startswith("helm install ")]
    return commands


def test_the_readme_has_helm_installs() -> None:
    assert len(_readme_helm_installs()) >= 2


@pytest.mark.parametrize("command", _readme_helm_installs(), ids=lambda words: " ".join(words[2:4]))
def test_each_readme_helm_install_renders(command: list[str]) -> None:
    args: list[str] = []
    words = iter(command[2:])
    for word in words:
        if word in CLUSTER_ONLY:
            continue
        if word == "--kubeconfig":
            next(words)
            continue
        for name, value in PLACEHOLDERS.items():
            word = word.replace(name, value)
        args.append(word)
    helm = str(build.ensure_binaries(["helm"])["helm"])
    # Our helm carries no version stamps: say which Kubernetes to render for (the chart's kubeVersion).
    rendered = subprocess.run([helm, "template", *args, "--kube-version", build.KUBERNETES_VERSION], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert "kind: Deployment" in rendered.stdout
