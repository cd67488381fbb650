"""A second kube-apiserver on a local cluster's own etcd, writing an audit log: who wrote what, when,
by the API server's own clock.

Two API servers on one store is how a highly available control plane runs; this one differs from
the cluster's only in its port and its audit flags, so a test can send some clients through it
(each with a client certificate of its own, so the log names them) and read afterwards, from the
server's side, every write each of them made.  Loopback only; stopped by :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from cryptography.x509.oid import ExtendedKeyUsageOID
from warmpool_devcluster import build, certs, cluster
from warmpool_devcluster.processes import free_port, stop_pid

#: Verbs that change the store (what "a write" means below).
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
#: Bound of the wait for the server to answer /readyz (it starts in a few seconds when idle).
READY_WAIT_S = 90.0


@dataclasses.dataclass(frozen=True)
class Write:
    """One write request as the API server audited it."""

    user: str
    verb: str
    resource: str
    name: str
    code: int
    #: the server's clock: when it received the request, and when it had answered it
    received: datetime.datetime
    answered: datetime.datetime

    def __str__(self) -> str:
        return (f"{self.user} {self.verb} {self.resource}/{self.name} -> {self.code} "
                f"[{self.received.time()} .. {self.answered.time()}]")


def _when(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class AuditedApiServer:
    def __init__(self, cluster_name: str, users: tuple[str, ...], workdir: Path) -> None:
        state = cluster._load_state(cluster_name)
        if state is None:
            raise RuntimeError(f"cluster {cluster_name!r} is not up")
        self.workdir = workdir
        self.pki = workdir / "pki"
        self.pki.mkdir(parents=True, exist_ok=True)
        source = cluster.state_dir(cluster_name) / "pki"
        for name in ("ca.crt", "ca.key"):
            shutil.copy(source / name, self.pki / name)
        for user in users:
            certs._issue(self.pki, user, certs._name(user, ("system:masters",)), ExtendedKeyUsageOID.CLIENT_AUTH)
        self.audit_log = workdir / "audit.log"
        policy = workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "users": list(users), "verbs": list(WRITE_VERBS)}, {"level": "None"}]}))
        self.port = free_port()
        binary = build.ensure_binaries(["kube-apiserver"])["kube-apiserver"]
        argv = cluster._apiserver_argv(binary, cluster.state_dir(cluster_name),
                                       dataclasses.replace(state, ports={**state.ports, "apiserver": self.port}))
        argv += ["--audit-policy-file", str(policy), "--audit-log-path", str(self.audit_log),
                 "--audit-log-format", "json", "--audit-log-mode", "blocking", "--audit-log-maxbackup", "1"]
        self.server = f"https://127.0.0.1:{self.port}"
        self._log = (workdir / "kube-apiserver.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self._users = users
        try:
            self._wait_ready(users[0])
        except BaseException:
            self.close()
            raise

    def kubeconfig(self, user: str, path: Path) -> Path:
        """A kubeconfig for ``user`` (one of the users given) straight to this server."""
        if user not in self._users:
            raise ValueError(f"no client certificate for {user!r}: give it in users")
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "audited", "cluster": {"server": self.server,
                                                          "certificate-authority": str(self.pki / "ca.crt")}}],
            "users": [{"name": user, "user": {"client-certificate": str(self.pki / f"{user}.crt"),
                                              "client-key": str(self.pki / f"{user}.key")}}],
            "contexts": [{"name": "audited", "context": {"cluster": "audited", "user": user}}],
            "current-context": "audited"}))
        path.chmod(0o600)
        return path

    def _wait_ready(self, user: str) -> None:
        config = self.kubeconfig(user, self.workdir / "ready.kubeconfig")
        kubectl = str(build.ensure_binaries(["kubectl"])["kubectl"])
        deadline = time.monotonic() + READY_WAIT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the audited kube-apiserver exited ({self.proc.returncode}): "
                                   f"{(self.workdir / 'kube-apiserver.log').read_text(errors='replace')[-3000:]}")
            answer = subprocess.run([kubectl, "--kubeconfig", str(config), "get", "--raw", "/readyz"],
                                    capture_output=True, text=True, timeout=30)
            if answer.returncode == 0 and answer.stdout.strip() == "ok":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the audited kube-apiserver not ready in {READY_WAIT_S:g}s: {answer.stderr[-500:]}")
            time.sleep(0.3)

    def writes(self) -> list[Write]:
        """Every write the audit log holds so far, in the order the server answered them."""
        found = []
        for line in self.audit_log.read_text(errors="replace").splitlines() if self.audit_log.exists() else ():
            event: dict[str, Any] = json.loads(line)
            if event.get("stage") != "ResponseComplete" or event.get("verb") not in WRITE_VERBS:
                continue
            ref = event.get("objectRef") or {}
            found.append(Write(user=str(event["user"]["username"]), verb=str(event["verb"]),
                               resource=str(ref.get("resource") or ""), name=str(ref.get("name") or ""),
                               code=int((event.get("responseStatus") or {}).get("code") or 0),
                               received=_when(event["requestReceivedTimestamp"]),
                               answered=_when(event["stageTimestamp"])))
        return sorted(found, key=lambda w: w.answered)

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_pid(self.proc.pid)
        self.proc.wait(timeout=30)
        self._log.close()
