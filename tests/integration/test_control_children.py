"""Child management (control/children.py), over the in-memory API server and against a real one
(the control_cluster fixture), the watches over it played by the test: made once, left alone while
it matches, brought back when it drifts, never written when it is someone else's."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from warmpool_operator.api.types import parse_spec
from warmpool_operator.control import children
from warmpool_operator.io.kube import SECRETS
from warmpool_operator.model import Obj, Target
from warmpool_operator.rules import builders, control_token

from tests.support.control_doubles import ControlCluster
from warmpool.contract.pods import CONTROL_SECRET_KEY, LABEL_MANAGED_BY, MANAGED_BY
from warmpool.kube import KubeError

#: A control key of the tests' own (the operator's lives in a Secret of its namespace).
KEY = b"k" * 32


def target(cluster: ControlCluster) -> Target:
    return Target("m", cluster.namespace,
                  parse_spec({"model": {"hostPath": {"path": "/models/m"}}, "pool": {"minWarm": 1}}))


async def owner(cluster: ControlCluster) -> Obj:
    return await cluster.warmmodel("m", {"model": {"hostPath": {"path": "/models/m"}}})


async def test_a_child_is_made_once_and_left_alone_while_it_matches(control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, settled, tgt, ns = await owner(cluster), children.Settled(), target(cluster), cluster.namespace
    made = await children.ensure(cluster.kube, cluster.cache, builders.build_service(tgt), wm, settled)
    assert made["metadata"]["ownerReferences"][0]["uid"] == wm["metadata"]["uid"]
    await cluster.watch()
    writes = len(cluster.kube.writes())
    for _ in range(3):
        await children.ensure(cluster.kube, cluster.cache, builders.build_service(tgt), wm, settled)
    assert len(cluster.kube.writes()) == writes
    assert children.ChildrenMemory(settled=settled).is_echo(cluster.cache.child("Service", ns, "m") or {})


async def test_a_drifted_child_is_applied_back_and_one_apply_cannot_fix_is_replaced_whole(
        control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, settled, tgt, ns = await owner(cluster), children.Settled(), target(cluster), cluster.namespace

    async def edit_then_ensure(spec: dict[str, Any], labels: dict[str, str] | None = None) -> list[str]:
        live = await cluster.kube.get_obj("services", ns, "m")
        assert live is not None
        meta = {**live["metadata"], "labels": {**live["metadata"]["labels"], **(labels or {})}}
        await cluster.kube.put("services", {**live, "metadata": meta, "spec": {**live["spec"], **spec}})
        await cluster.watch()
        before = len(cluster.kube.writes("services"))
        await children.ensure(cluster.kube, cluster.cache, builders.build_service(tgt), wm, settled)
        return [c.method for c in cluster.kube.writes("services")[before:]]

    await children.ensure(cluster.kube, cluster.cache, builders.build_service(tgt), wm, settled)
    # A field of ours edited by hand: server-side apply puts ours back.
    assert await edit_then_ensure({"publishNotReadyAddresses": True}) == ["PATCH"]
    # A selector key someone added: the selector is atomic, so the apply takes all of it back.
    assert await edit_then_ensure({"selector": {**builders.service_selector("m"), "extra": "x"}},
                                  labels={"team": "theirs"}) == ["PATCH"]
    whole = await cluster.kube.get_obj("services", ns, "m")
    assert whole is not None and whole["spec"]["selector"] == builders.service_selector("m")
    assert whole["metadata"]["labels"]["team"] == "theirs"  # others' labels stay, ours win
    # A port someone put in ours' place: ports merge by port and protocol, so theirs survives the
    # apply beside ours: replaced whole.
    assert await edit_then_ensure({"ports": [{"name": "http", "port": 9999}]}) == ["PATCH", "PUT"]
    fixed = await cluster.kube.get_obj("services", ns, "m")
    assert fixed is not None and [p["port"] for p in fixed["spec"]["ports"]] == [tgt.spec.pod.port]
    # An apply the API server refuses (a merge that is invalid): replaced whole at once.
    cluster.kube.faults[("PATCH", "services")] = KubeError(422, "Invalid", "Duplicate value")
    assert await edit_then_ensure({"ports": [{"name": "http", "port": 1}]}) == ["PATCH", "PUT"]
    fixed = await cluster.kube.get_obj("services", ns, "m")
    assert fixed is not None and [p["port"] for p in fixed["spec"]["ports"]] == [tgt.spec.pod.port]


async def test_a_name_someone_else_holds_is_never_written(control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, tgt, ns = await owner(cluster), target(cluster), cluster.namespace
    theirs = await cluster.kube.put("configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": builders.configmap_name("m"), "namespace": ns}, "data": {"theirs": "keep"}})
    made = await children.ensure_supporting(cluster.kube, cluster.cache, tgt, wm, children.Settled(), KEY, "")
    assert [str(c) for c in made.conflicts] == [f"ConfigMap {ns}/{builders.configmap_name('m')} exists and is not "
                                                "owned by this WarmModel"]
    assert made.mounted_conflict and made.token  # the Secret is still ours and made
    assert await cluster.kube.get_obj("configmaps", ns, builders.configmap_name("m")) == theirs


async def test_an_object_the_watch_has_not_shown_yet_is_read_after_the_409(control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, settled, tgt = await owner(cluster), children.Settled(), target(cluster)
    await children.ensure(cluster.kube, cluster.cache, builders.build_pdb(tgt), wm, settled)
    # The watch has not delivered it: create says 409, and the object is read by name.
    again, created = await children.get_or_create(cluster.kube, cluster.cache, builders.build_pdb(tgt))
    assert not created and again["metadata"]["name"] == "m"
    assert [c.method for c in cluster.kube.calls if c.plural == "poddisruptionbudgets"] == ["POST", "POST", "GET"]


def _token_of(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][CONTROL_SECRET_KEY]).decode()


async def test_the_control_token_is_derived_written_and_never_read_back(control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, tgt, ns = await owner(cluster), target(cluster), cluster.namespace
    name = builders.control_secret_name("m")
    token = await children.ensure_secret(cluster.kube, tgt, wm, KEY, "")
    assert token == control_token.derive(KEY, ns, "m", str(wm["metadata"]["uid"])) and len(token) > 30
    secret = await cluster.kube.get_obj("secrets", ns, name)
    assert secret is not None and _token_of(secret) == token
    calls = len(cluster.kube.calls)
    assert await children.ensure_secret(cluster.kube, tgt, wm, KEY, token) == token
    assert len(cluster.kube.calls) == calls  # written by this process: nothing to do
    # A restart (nothing known): the same token, written again without reading the Secret.
    assert await children.ensure_secret(cluster.kube, tgt, wm, KEY, "") == token
    # Edited by hand (a token workers would then refuse): ours is written back.
    edited = {CONTROL_SECRET_KEY: base64.b64encode(b"x").decode()}
    await cluster.kube.patch(SECRETS, ns, name, {"data": edited})
    assert await children.ensure_secret(cluster.kube, tgt, wm, KEY, "") == token
    patched = await cluster.kube.get_obj("secrets", ns, name)
    assert patched is not None and _token_of(patched) == token
    # Another key (the key's Secret deleted and made again): every token changes.
    other = await children.ensure_secret(cluster.kube, tgt, wm, b"o" * 32, token)
    rekeyed = await cluster.kube.get_obj("secrets", ns, name)
    assert other != token and rekeyed is not None and _token_of(rekeyed) == other
    assert all(c.method != "GET" for c in cluster.kube.calls if c.plural == "secrets")


async def test_someone_elses_secret_is_a_conflict_and_left_untouched(control_cluster: ControlCluster) -> None:
    cluster = control_cluster
    wm, tgt, ns = await owner(cluster), target(cluster), cluster.namespace
    name = builders.control_secret_name("m")
    theirs = await cluster.kube.put("secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": name, "namespace": ns, "labels": {"team": "a"}}, "data": {"k": base64.b64encode(b"v").decode()}})
    with pytest.raises(children.ChildConflict):
        await children.ensure_secret(cluster.kube, tgt, wm, KEY, "")
    # Labelled as ours, but owned by another WarmModel of the name (deleted, made again): not ours.
    await cluster.kube.put("secrets", {**theirs, "metadata": {**theirs["metadata"], "labels": {
        LABEL_MANAGED_BY: MANAGED_BY}, "ownerReferences": [
        {"apiVersion": "warmpool.dev/v1alpha1", "kind": "WarmModel", "name": "m", "uid": "an-older-uid"}]}})
    before = await cluster.kube.get_obj("secrets", ns, name)
    with pytest.raises(children.ChildConflict):
        await children.ensure_secret(cluster.kube, tgt, wm, KEY, "")
    after = await cluster.kube.get_obj("secrets", ns, name)
    assert before is not None and after is not None and after["data"] == before["data"] == theirs["data"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # never written
    assert all(c.method != "GET" for c in cluster.kube.calls if c.plural == "secrets")
