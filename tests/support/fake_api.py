"""The control-layer tests' in-memory backend, for tests that run in milliseconds (as kopf's own
tests stand in for the API with mocks): :class:`FakeKube` answers the operator's client from a
store (create with 409 on a taken name, get, list by label, replace with 409 on a stale
resourceVersion, merge patch, JSON patch (a failed ``test`` is a 422 that changes nothing),
server-side apply as a merge that keeps what others set where the real server does, the status
subresource, delete; uids, resourceVersions and generations as the
API server keeps them), and
:class:`FakeCluster` plays the watches over it (see control_doubles.py).

Every test that uses it runs against the real API server too (api_world.py): where the two
disagree, the fake is wrong."""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Mapping
from typing import Any

from warmpool_operator.model import Obj

from tests.support.control_doubles import PATH, ControlCluster, TestKube
from warmpool.kube import APPLY_PATCH, JSON_PATCH, KubeError


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch: maps merge, null removes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


#: Server-side apply's schema where it differs from a plain merge, for the fields the operator's
#: children carry: maps the server replaces whole (atomic), and lists it merges by key (what
#: another manager added survives an apply).
ATOMIC_MAPS = {("spec", "selector"), ("spec", "podSelector")}
LIST_MAP_KEYS = {("spec", "ports"): ("port", "protocol")}


def apply(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Server-side apply with force, of the fields of ``patch``, over ``target``."""
    if path in ATOMIC_MAPS or (not isinstance(patch, Mapping) and path not in LIST_MAP_KEYS):
        return copy.deepcopy(patch)
    if path in LIST_MAP_KEYS:
        keys = LIST_MAP_KEYS[path]

        def key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
            return tuple(entry.get(k, "TCP" if k == "protocol" else None) for k in keys)

        ours = {key(entry): entry for entry in patch}
        kept = [copy.deepcopy(entry) for entry in target or [] if key(entry) not in ours]
        return kept + [copy.deepcopy(entry) for entry in patch]
    out = dict(target) if isinstance(target, Mapping) else {}
    for name, value in patch.items():
        out[name] = apply(out.get(name), value, (*path, name))
    return out


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def json_patch(target: Obj, operations: list[Mapping[str, Any]]) -> Obj:
    """RFC 6902 (test, add, replace, remove), all or nothing: any failure is a 422, as the server's."""
    out = copy.deepcopy(target)
    for op in operations:
        try:
            _apply_one(out, op)
        except (IndexError, ValueError, TypeError, AttributeError):
            raise KubeError(422, "Invalid", f"the server rejected our request: {op['op']} of {op['path']}") from None
    return out


def _apply_one(out: Obj, op: Mapping[str, Any]) -> None:
    *parents, last = _pointer(str(op["path"]))
    node: Any = out
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise KubeError(422, "Invalid", f"the server rejected our request: no {op['path']}")
    if isinstance(node, list):
        index = int(last)
        present, value = index < len(node), node[index] if index < len(node) else None
    else:
        present, value = last in node, node.get(last)
    if op["op"] == "test":
        if not present or value != op["value"]:
            raise KubeError(422, "Invalid", f"the server rejected our request: test of {op['path']} failed")
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace" and not present:
            raise KubeError(422, "Invalid", f"the server rejected our request: no {op['path']}")
        node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
    elif op["op"] == "remove" and present:
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise KubeError(422, "Invalid", f"the server rejected our request: {op['op']} of {op['path']}")


class FakeKube(TestKube):
    def __init__(self) -> None:
        super().__init__(api_client=None)  # never called: request is ours
        self.store: dict[tuple[str, str, str], Obj] = {}  # (plural, namespace, name) -> object
        self._versions = itertools.count(1)
        self._uids = itertools.count(1)

    async def close(self) -> None:
        return None

    def _store(self, plural: str, obj: Mapping[str, Any]) -> Obj:
        """Store an object as the API server would have it (uid, resourceVersion, generation)."""
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        key = (plural, str(meta["namespace"]), str(meta["name"]))
        before = self.store.get(key)
        meta.setdefault("uid", f"uid-{next(self._uids)}")
        meta["resourceVersion"] = str(next(self._versions))
        if "spec" in stored:
            meta.setdefault("generation", 1)
            if before is not None and before.get("spec") != stored["spec"]:
                meta["generation"] = int(before["metadata"].get("generation") or 0) + 1
        self.store[key] = stored
        return copy.deepcopy(stored)

    async def put(self, plural: str, obj: Mapping[str, Any]) -> Obj:
        return self._store(plural, obj)

    async def get_obj(self, plural: str, namespace: str, name: str) -> Obj | None:
        found = self.store.get((plural, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def delete_obj(self, plural: str, namespace: str, name: str) -> None:
        del self.store[(plural, namespace, name)]

    async def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Obj:
        match = PATH.match(path)
        assert match is not None, f"a path the fake does not know: {path}"
        plural, namespace, name, sub = match["plural"], match["ns"], match["name"], match["sub"]
        self.record(method, plural, name, sub, copy.deepcopy(body))
        key = (plural, namespace, str(name))
        live = self.store.get(key)
        if method == "GET" and name is None:
            return {"items": [copy.deepcopy(o) for (p, ns, _), o in sorted(self.store.items())
                              if p == plural and ns == namespace and _selected(o, (query or {}).get("labelSelector"))]}
        if method == "POST":
            meta = body["metadata"]
            if (plural, namespace, meta["name"]) in self.store:
                raise KubeError(409, "AlreadyExists", f"{plural} {meta['name']} already exists")
            return self._store(plural, body)
        if live is None:
            raise KubeError(404, "NotFound", f"{plural} {name} not found")
        if method == "GET":
            return copy.deepcopy(live)
        if method == "DELETE":
            del self.store[key]
            return {}
        return self._write(plural, key, live, method, body, sub, content_type)

    def _write(self, plural: str, key: tuple[str, str, str], live: Obj, method: str, body: Any, sub: str | None,
               content_type: str) -> Obj:
        if method == "PUT":
            if body["metadata"].get("resourceVersion") not in (None, live["metadata"]["resourceVersion"]):
                raise KubeError(409, "Conflict", "the object has been modified")
            new = copy.deepcopy(body)
            new["metadata"] = {**body["metadata"], "uid": live["metadata"]["uid"]}
        elif sub == "status":
            new = {**live, "status": merge(live.get("status"), body.get("status"))}
        elif content_type == APPLY_PATCH:
            new = apply(live, body)
        elif content_type == JSON_PATCH:
            new = json_patch(live, body)
        else:
            new = merge(live, body)
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        if "spec" in new and new.get("spec") != live.get("spec"):
            new["metadata"]["generation"] = int(live["metadata"].get("generation") or 0) + 1
        self.store[key] = new
        return copy.deepcopy(new)


def _selected(obj: Mapping[str, Any], selector: str | None) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    pairs = [term.split("=", 1) for term in (selector or "").split(",") if term]
    return all(labels.get(k) == v for k, v in pairs)


class FakeCluster(ControlCluster):
    """An in-memory API server (:class:`FakeKube`) and the operator's watches over it."""

    def __init__(self) -> None:
        super().__init__(f"team-{uuid.uuid4().hex[:8]}")
        self.kube: FakeKube = FakeKube()

    async def watch(self) -> None:
        self.index(self.kube.store.values())
