"""`warmpool demo --object-store`'s pure parts: the example WarmModel rewritten to read the
bucket (and still accepted by the operator's own parser), the credentials Secret, and the
fill progress line read from status.cacheNodes.  The whole path runs in `make demo-object-store`."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml
from warmpool_dev import demo, demo_object_store
from warmpool_operator.api.types import parse_spec

from warmpool.contract.files import S3_SECRET_ACCESS_KEY_ID_KEY, S3_SECRET_SECRET_ACCESS_KEY_KEY

pytestmark = pytest.mark.unit

STORE = demo_object_store.ObjectStore("http://127.0.0.1:8333", "models", Path("/nonexistent/credentials"),
                                      "WPKEYID", "s3cr3t")


def test_the_example_reads_the_bucket_on_the_agents_node(repo_root: Path) -> None:
    body = yaml.safe_load(demo._manifest(Path("/models/smollm2"), demo.find_checkout(repo_root)))
    rewritten = demo_object_store.from_store(body, STORE)
    model = rewritten["spec"]["model"]
    assert "nodeCache" not in model
    assert model["s3"] == {"endpoint": STORE.endpoint, "bucket": "models", "prefix": demo_object_store.PREFIX,
                           "secretRef": {"name": demo_object_store.SECRET}}
    assert rewritten["spec"]["pod"]["nodeSelector"] == {"kubernetes.io/hostname": demo_object_store.NODE}
    spec = parse_spec(rewritten["spec"])  # the operator accepts it as it is
    assert spec.model.object_store() is not None


def test_the_secret_holds_the_credentials_under_the_keys_the_agent_reads() -> None:
    secret = yaml.safe_load(demo_object_store.secret_manifest(STORE, "ns"))
    assert secret["metadata"] == {"name": demo_object_store.SECRET, "namespace": "ns"}
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == {S3_SECRET_ACCESS_KEY_ID_KEY: "WPKEYID",
                       S3_SECRET_SECRET_ACCESS_KEY_KEY: "s3cr3t"}
    assert "s3cr3t" not in repr(STORE)


def test_fill_progress_reads_status_cache_nodes() -> None:
    assert demo_object_store.fill_line({}) == "no node agent has reported yet"
    status = {"cacheNodes": [
        {"node": "warmpool-node-0", "bytesCached": 64 << 20, "bytesTotal": 256 << 20, "published": False},
        {"node": "warmpool-node-1", "bytesCached": 256 << 20, "bytesTotal": 256 << 20, "published": True},
    ]}
    assert demo_object_store.fill_line(status) == (
        "warmpool-node-0: 64/256 MiB (25 %), filling; warmpool-node-1: 256/256 MiB (100 %), published")
