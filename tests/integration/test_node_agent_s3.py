"""Push -> fill -> a WarmModel goes warm from the cache, with a real object store.

SeaweedFS (built from the Go module proxy) runs on loopback with real credentials.  A tiny
real safetensors checkpoint is pushed with the real `warmpool model push` command; a
WarmModel with ``spec.model.s3`` names it and a Secret with the credentials; a real
`warmpool node-agent` process reads the Secret, fills the node cache from the store under
its fill Lease and reports ``status.cacheNodes``; the operator's worker pod (a real tiny
worker, in a container on the local cluster's real node) starts on the published revision and serves a completion.

Wrong credentials in the Secret are reported in the WarmModel's status naming the access key
id (never the secret); no pod starts; fixing the Secret makes the same agent fill and the
pool goes warm.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.seaweedfs import SeaweedHandle, start_seaweedfs
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.s3 import S3Credentials, S3SourceConfig, make_client
from warmpool_nodecache.source_errors import unavailable_text

from tests.support.e2e import World, http
from tests.support.node_agent import (
    NODE,
    Agent,
    agent_processes,
    assert_files_identical,
    cache_entry,
    cache_world,
    node_has_label,
)
from warmpool import cachekeys
from warmpool.contract.api import API_GROUP_VERSION, KIND
from warmpool.contract.files import MODEL_MOUNT_PATH, S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY
from warmpool.contract.nodecache import CACHE_DOMAINS_DIR, CACHE_GRANTED_DIR, CACHE_REVISIONS_DIR
from warmpool.contract.pods import WORKER_CONTAINER

pytestmark = pytest.mark.integration

SECRET = "models-s3"
#: The agent's --interval in the test of a failing fill (its retries come no faster).
INTERVAL_S = 3.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedHandle]:
    handle = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    with cache_world(cluster, namespace, tmp_path, nodes=(NODE,)) as w:
        yield w


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    with agent_processes(tmp_path) as started:
        yield started


def push(store: SeaweedHandle, model: Path, prefix: str) -> str:
    """`warmpool model push` as a user runs it; the revision's digest it prints."""
    done = subprocess.run(
        [sys.executable, "-m", "warmpool", "model", "push", str(model), f"s3://{store.bucket}/{prefix}",
         "--endpoint", store.endpoint, "--credentials-file", str(store.credentials_file)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    digest = done.stdout.strip()
    assert digest.startswith("sha256:") and len(digest) == 71, done.stdout
    return digest


def apply_secret(world: World, key_id: str, secret: str) -> None:
    """The credentials Secret, through kubectl's stdin (never on a command line)."""
    def encode(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    world.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "type": "Opaque",
                 "data": {S3_SECRET_ACCESS_KEY_ID_KEY: encode(key_id),
                          S3_SECRET_SECRET_ACCESS_KEY_KEY: encode(secret)}})


def s3_warmmodel(name: str, store: SeaweedHandle, prefix: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": API_GROUP_VERSION, "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"s3": {"endpoint": store.endpoint, "bucket": store.bucket, "prefix": prefix,
                             "secretRef": {"name": SECRET}},
                      "revision": "r1"},
            "pool": {"replicas": 1, "minWarm": 1, "maxReplicas": 2},
            "warmup": {"buckets": [8], "prompts": ["hello there"], "timeoutSeconds": 120},
            "pod": {"workerArgs": ["--device=cpu", "--prompts-per-bucket=1", "--decode-tokens=2"],
                    "nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def assert_warm_from_the_cache(world: World, name: str, digest: str, model: Path, cache: Path) -> None:
    """The pool serves from the published revision, which is the pushed model byte for byte;
    the node's entry says published, all bytes cached; the node carries the revision's label."""
    pod = world.pods(name)[0]
    code, text = http(world.base(pod) + "/v1/completions",
                      {"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert code == 200, text[:500]
    answer = json.loads(text)
    assert answer["model"] == name and answer["usage"]["completion_tokens"] >= 1, answer

    hex_digest = digest.removeprefix("sha256:")
    assert_files_identical(cache / CACHE_REVISIONS_DIR / hex_digest, model)
    mounts = world.get("deployment", name)["spec"]["template"]["spec"]["containers"]
    worker = next(c for c in mounts if c["name"] == WORKER_CONTAINER)
    model_mount = next(m for m in worker["volumeMounts"] if m["mountPath"] == MODEL_MOUNT_PATH)
    # Only its namespace's link to this revision: never the cache root, never another tenant's.
    assert model_mount["subPath"] == f"{CACHE_DOMAINS_DIR}/{world.ns}/{CACHE_GRANTED_DIR}/{hex_digest}", model_mount

    entry = world.wait(lambda: (e := cache_entry(world, name, NODE)) and e.get("published") and e, 30,
                       "the node's published entry")
    assert entry["revision"] == digest and "message" not in entry, entry
    assert entry["bytesCached"] == entry["bytesTotal"] > 0, entry
    label = cachekeys.cache_node_label(digest)
    world.wait(lambda: node_has_label(world, NODE, label), 30, f"node label {label}")


def test_pushed_model_goes_warm_from_the_s3_cache(
    world: World, agents: list[Agent], store: SeaweedHandle, tiny_model: Path, tmp_path: Path,
) -> None:
    digest = push(store, tiny_model, "tiny/r1")
    apply_secret(world, store.access_key_id, store.secret_access_key)
    agents.append(Agent(world.cluster, world.ns, NODE, tmp_path / "cache", tmp_path / "agent-0.log"))
    world.apply(s3_warmmodel("from-s3", store, "tiny/r1", NODE))
    world.wait_ready("from-s3", warm=1, timeout=240)
    assert_warm_from_the_cache(world, "from-s3", digest, tiny_model, tmp_path / "cache")
    # One fill on a fresh cache: it reports every byte of the revision as fetched, the
    # checkpoint's header blocks (fetched first, to order the rest by heat) included.
    total = cache_entry(world, "from-s3", NODE)["bytesTotal"]  # type: ignore[index]
    log = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert re.search(rf"published {digest} \(\d+ blocks, {total} bytes fetched here\)", log), log[-2000:]


def test_wrong_credentials_are_reported_by_key_id_and_a_fixed_secret_goes_warm(
    world: World, agents: list[Agent], store: SeaweedHandle, tiny_model: Path, tmp_path: Path,
) -> None:
    digest = push(store, tiny_model, "tiny/r2")
    wrong = "wrong-" + store.secret_access_key[::-1]
    apply_secret(world, store.access_key_id, wrong)
    cache = tmp_path / "cache"
    agent = Agent(world.cluster, world.ns, NODE, cache, tmp_path / "agent-0.log")
    agents.append(agent)
    world.apply(s3_warmmodel("bad-creds", store, "tiny/r2", NODE))

    entry = world.wait(lambda: (e := cache_entry(world, "bad-creds", NODE)) and e.get("message") and e, 60,
                       "the agent's error in status.cacheNodes")
    message = entry["message"]
    # The status says what it says of every failed source (no oracle of what answered); the
    # agent's log, read by whoever runs the node, names the key id the store refused.
    assert message.startswith(unavailable_text("s3://models/tiny/r2")), message
    assert wrong not in message and store.secret_access_key not in message, message
    refusal = f"refused access key id {store.access_key_id!r}"
    world.wait(lambda: refusal in (tmp_path / "agent-0.log").read_text(errors="replace"), 30, "the refusal logged")
    assert "revision" not in entry and not entry.get("published"), entry
    # No manifest read, so no revision: the operator makes no pod, and the cache holds nothing.
    assert world.pods("bad-creds") == []
    revisions = cache / CACHE_REVISIONS_DIR
    assert not revisions.exists() or not any(revisions.iterdir()), list(revisions.iterdir())
    log = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert wrong not in log and store.secret_access_key not in log

    apply_secret(world, store.access_key_id, store.secret_access_key)  # the same agent reads it again
    world.wait_ready("bad-creds", warm=1, timeout=240)
    assert agent.running()
    assert_warm_from_the_cache(world, "bad-creds", digest, tiny_model, cache)


def test_an_object_missing_from_the_bucket_fails_the_fill_until_pushed_again(
    world: World, agents: list[Agent], store: SeaweedHandle, tiny_model: Path, tmp_path: Path,
) -> None:
    """The manifest names a file the bucket lacks (deleted, or a push cut short before it): the
    fill fails naming the key, the worker pod waits on a half cache (the agent had fetched the
    checkpoint's header block), and the same agent publishes once the model is pushed again;
    the failure's message goes with the publish, and a failed fill is retried on the next
    interval's pass, not at once, with the source opened again from the Secret as it is then."""
    digest = push(store, tiny_model, "tiny/r3")
    client = make_client(S3SourceConfig(store.endpoint, store.bucket, credentials=S3Credentials(
        store.access_key_id, store.secret_access_key), attempts=2))
    client.delete_object(Bucket=store.bucket, Key="tiny/r3/tokenizer.json")
    apply_secret(world, store.access_key_id, store.secret_access_key)
    cache = tmp_path / "cache"
    agent = Agent(world.cluster, world.ns, NODE, cache, tmp_path / "agent-0.log", interval_s=INTERVAL_S)
    agents.append(agent)
    world.apply(s3_warmmodel("missing", store, "tiny/r3", NODE))

    def failed() -> dict[str, Any] | None:
        found = cache_entry(world, "missing", NODE)
        return found if found and "fill failed" in found.get("message", "") else None

    entry = world.wait(failed, 120, "the fill's failure in status.cacheNodes")
    assert unavailable_text("s3://models/tiny/r3") in entry["message"], entry
    assert "s3://models/tiny/r3/tokenizer.json" in (tmp_path / "agent-0.log").read_text(errors="replace")
    assert entry["revision"] == digest and not entry["published"], entry
    assert 0 < entry["bytesCached"] < entry["bytesTotal"], entry  # a half cache ...
    pods = world.pods("missing")
    assert len(pods) == 1, pods  # ... and the pod waits on it, its worker not started
    statuses = pods[0]["status"].get("containerStatuses") or []
    assert not any((s.get("state") or {}).get("running") for s in statuses), statuses
    assert not (cache / CACHE_REVISIONS_DIR / digest.removeprefix("sha256:")).exists()
    world.wait(lambda: _fill_failures(tmp_path / "agent-0.log") >= 2, 60, "a second failed fill")

    # After a failed fill the agent opens the source again from the Secret as it is now (rotated
    # credentials are taken up): here the Secret turns wrong, the manifest read fails (the
    # status's message is the read's now, not the fill's) and the log names the key id.
    wrong = "wrong-" + store.secret_access_key[::-1]
    apply_secret(world, store.access_key_id, wrong)
    refused = world.wait(lambda: (e := cache_entry(world, "missing", NODE)) and e.get("message", "").startswith(
        unavailable_text("s3://models/tiny/r3")) and e.get("message"), 60, "the rotated Secret's refusal")
    assert wrong not in str(refused), refused
    log = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert f"refused access key id {store.access_key_id!r}" in log and wrong not in log
    apply_secret(world, store.access_key_id, store.secret_access_key)
    push(store, tiny_model, "tiny/r3")  # sends only the missing object
    world.wait_ready("missing", warm=1, timeout=240)
    assert agent.running()
    assert_warm_from_the_cache(world, "missing", digest, tiny_model, cache)
    # Failed fills came one pass interval apart at the least, not back to back.
    failures = _fill_failure_times(tmp_path / "agent-0.log")
    gaps = [later - earlier for earlier, later in itertools.pairwise(failures)]
    assert gaps and min(gaps) >= INTERVAL_S - 0.5, gaps


def _fill_failure_times(log: Path) -> list[float]:
    """When the agent logged each failed fill (seconds since the epoch, from its log lines)."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        if "fill failed" in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            times.append(stamp.timestamp())
    return times


def _fill_failures(log: Path) -> int:
    return len(_fill_failure_times(log))
