"""The node agent against hostile WarmModels on the real local control plane, while a good one is
served by the same agent: redirects, a body that never ends, one that trickles, sizes that lie,
bytes from elsewhere, an internal address, and two sources an older CRD admitted that do not parse.

The hostile store and the good one listen on 127.0.0.1 (the agent allows it, as an operator would
allow an in-cluster store); a canary on 127.0.0.2 stands for every internal endpoint.  Nothing
may reach the canary, no status or Event may carry the size or digest of what a source sent, and
the good WarmModel goes warm meanwhile.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from warmpool_devcluster.testing import ClusterHandle
from warmpool_nodecache.manifest import build_manifest, write_manifest
from warmpool_nodecache.source_errors import SOURCE_UNAVAILABLE

from tests.integration.test_node_agent import http_warmmodel
from tests.support.e2e import World, install_crd
from tests.support.hostile_server import SECRET, HostileServer, endless, fixed, hostile_server, redirect, trickle
from tests.support.node_agent import NODE, Agent, agent_processes, cache_entry, cache_world
from tests.support.range_server import serve_directory
from warmpool.contract.api import CRD_NAME, KIND, PLURAL
from warmpool.contract.files import MANIFEST_FILENAME

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024
MANIFEST_LIMIT = 1024 * 1024
GOOD = "well-formed"
LIE = 777_777  # the size a lying HEAD gives: it must never show up in a status
#: The CRD's patterns before they admitted only URLs that parse (objects stored then still exist).
OLD_URL_PATTERN = r"^https?://[^\s/]+(/\S*)?$"
OLD_ENDPOINT_PATTERN = r"^https?://[^\s/]+/?$"
UNAVAILABLE = re.escape(SOURCE_UNAVAILABLE)


@pytest.fixture()
def world(cluster: ClusterHandle, namespace: str, crd: str, tmp_path: Path) -> Iterator[World]:
    with cache_world(cluster, namespace, tmp_path) as w:
        yield w


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    with agent_processes(tmp_path) as started:
        yield started


def _copy_model(tiny_model: Path, root: Path) -> None:
    """The tiny model as a revision of its own (a file naming it): the same bytes would be the
    same revision, published once for all of them."""
    shutil.copytree(tiny_model, root)
    (root / "revision.txt").write_text(root.name)
    write_manifest(root, build_manifest(root, block_size=BLOCK))


def _arm(hostile: HostileServer, canary: HostileServer, store: Path) -> dict[str, str]:
    """The hostile routes; WarmModel name -> what its entry's message must say (a pattern)."""
    routes = hostile.state.routes
    manifest = MANIFEST_FILENAME
    routes[f"/redirect/{manifest}"] = redirect(f"{canary.url}/latest/meta-data/iam/")
    routes[f"/huge/{manifest}"] = endless(hostile.state, f"/huge/{manifest}")
    routes[f"/trickle/{manifest}"] = trickle(hostile.state, f"/trickle/{manifest}", interval_s=0.2, max_s=300)
    routes["/sizes/config.json"] = fixed((store / "sizes" / "config.json").read_bytes(), head_length=LIE)
    weights = (store / "badbytes" / "model.safetensors").stat().st_size
    routes["/badbytes/model.safetensors"] = fixed((SECRET * (weights // len(SECRET) + 1))[:weights])
    routes["/blockredirect/model.safetensors"] = redirect(f"{canary.url}/secret", status=307)
    # A source that was refused or answered wrongly reads the same in status (no port-scan
    # oracle); bytes that came back wrong still say so.  The agent's log keeps the cause (DETAIL).
    return {"redirect": UNAVAILABLE, "huge": UNAVAILABLE, "trickle": UNAVAILABLE,
            "sizes": "the source has another size",
            "badbytes": "do not hash to it|never matched the manifest's SHA-256", "blockredirect": UNAVAILABLE,
            "internal": UNAVAILABLE}


#: What the agent's log says of each source its status only calls unavailable.
DETAIL = {"redirect": "a redirect", "huge": f"larger than the {MANIFEST_LIMIT}-byte limit",
          "trickle": "within the read deadline", "blockredirect": "a redirect", "internal": "in a loopback"}


def _admit_as_an_older_crd_did(world: World, bodies: list[dict[str, Any]]) -> None:
    """Create ``bodies`` under the old patterns, then put the CRD back (stored objects stay)."""
    spec = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/model/properties"
    patch = [{"op": "replace", "path": f"{spec}/http/properties/url/pattern", "value": OLD_URL_PATTERN},
             {"op": "replace", "path": f"{spec}/s3/properties/endpoint/pattern", "value": OLD_ENDPOINT_PATTERN}]
    world.cluster.kubectl("patch", "crd", CRD_NAME, "--type=json", "-p", json.dumps(patch))
    def create(body: dict[str, Any]) -> bool:
        return world.cluster.kubectl("-n", world.ns, "create", "-f", "-", input=json.dumps(body),
                                     check=False).returncode == 0

    try:
        for body in bodies:  # the API server may take a moment to serve the loosened schema
            world.wait(functools.partial(create, body), 30, f"{body['metadata']['name']} admitted by the old patterns")
    finally:
        install_crd(world.cluster, field_manager="warmpool-tests")


def _messages(world: World) -> dict[str, str]:
    found = {}
    for wm in world.get(PLURAL)["items"]:
        for entry in (wm.get("status") or {}).get("cacheNodes") or []:
            if entry.get("message"):
                found[wm["metadata"]["name"]] = str(entry["message"])
    return found


def test_hostile_sources_are_contained_while_a_good_warmmodel_is_served(
    world: World, agents: list[Agent], tiny_model: Path, tmp_path: Path,
) -> None:
    from warmpool_dev.testing_models import make_tiny_llama

    # Weights of their own: blocks the good fill stored would otherwise be taken from the cache
    # (content-addressed) and the hostile sources never asked for them.
    other = make_tiny_llama(tmp_path / "other", layers=2, seed=11)
    store = tmp_path / "hostile"
    for name in ("sizes", "badbytes", "blockredirect"):
        _copy_model(other, store / name)
    _copy_model(tiny_model, tmp_path / "good")
    with hostile_server("127.0.0.2") as canary, hostile_server("127.0.0.1", directory=store) as hostile, \
            serve_directory(tmp_path / "good") as good:
        says = _arm(hostile, canary, store)
        agents.append(Agent(world.cluster, world.ns, NODE, tmp_path / "cache", tmp_path / "agent-0.log",
                            interval_s=2, extra=("--max-manifest-bytes", str(MANIFEST_LIMIT),
                                                 "--source-deadline", "4", "--manifest-reads", "3")))
        world.kubectl("create", "secret", "generic", "keys", "--from-literal=AWS_ACCESS_KEY_ID=AKID",
                      "--from-literal=AWS_SECRET_ACCESS_KEY=secret")
        unparsable = http_warmmodel("old-url", "http://h:abc/m", NODE)
        old_s3 = http_warmmodel("old-s3", "http://unused", NODE)
        old_s3["spec"]["model"] = {"s3": {"endpoint": "http://bad_host:1", "bucket": "models",
                                          "secretRef": {"name": "keys"}}, "revision": "r1"}
        _admit_as_an_older_crd_did(world, [unparsable, old_s3])
        says |= {"old-url": "does not parse", "old-s3": "not a valid S3 endpoint"}
        for name in says.keys() - {"internal", "old-url", "old-s3"}:
            world.apply(http_warmmodel(name, f"{hostile.url}/{name}", NODE))
        world.apply(http_warmmodel("internal", f"{canary.url}/m", NODE))
        # Named to be listed after every hostile one: a pass that stops at one never reaches it.
        world.apply(http_warmmodel(GOOD, good.url, NODE))

        # The good WarmModel is filled and goes warm while the others fail around it.
        world.wait_ready(GOOD, warm=1, timeout=300)
        entry: dict[str, Any] = world.wait(lambda: (e := cache_entry(world, GOOD, NODE)) and e.get("published")
                                           and e, 60, "the good entry published")
        def all_said() -> dict[str, str]:
            found = _messages(world)
            assert says.keys() <= found.keys(), f"no message yet for {sorted(says.keys() - found.keys())}"
            return found

        messages = world.wait(all_said, 180, f"a message for each of {sorted(says)}")
        for name, expected in says.items():
            assert re.search(expected, messages[name]), (name, messages[name])
        log = (tmp_path / "agent-0.log").read_text(errors="replace")
        for name, detail in DETAIL.items():
            assert re.search(rf"{world.ns}/{name}: .*{re.escape(detail)}", log), (name, detail)
        assert canary.state.count() == 0, canary.state.requests

    # No status carries what a source sent: no size it gave, no digest of bytes it returned.
    text = json.dumps(messages)
    weights = (store / "badbytes" / "model.safetensors").stat().st_size
    sent = (SECRET * (weights // len(SECRET) + 1))[:weights]
    digests = {hashlib.sha256(sent[i:i + BLOCK]).hexdigest() for i in range(0, weights, BLOCK)}
    assert str(LIE) not in text and not any(d in text for d in digests), text
    assert SECRET.decode() not in text and base64.b64encode(SECRET).decode() not in text
    # Each failure was an Event on its WarmModel too.
    events = world.get("events")["items"]
    warned = {e["involvedObject"]["name"] for e in events if e.get("reason") in (
        "NodeCacheReadFailed", "NodeCacheFillFailed") and e["involvedObject"].get("kind") == KIND}
    assert says.keys() <= warned, sorted(warned)
    assert not any(str(LIE) in e.get("message", "") for e in events)
    assert "message" not in entry and entry["path"].endswith(entry["revision"].removeprefix("sha256:"))
