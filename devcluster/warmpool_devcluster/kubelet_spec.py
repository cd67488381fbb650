"""Pure translation of a pod spec into what a local process needs, the way a kubelet does it.

``$(VAR)`` expansion, the container environment (env, valueFrom, envFrom), the files of
configMap / secret / downwardAPI / projected volumes, and the rewriting of mount paths
into local directories (without root there are no mount namespaces, so a container's
``/etc/config/x`` in its command, args, env or workingDir becomes the local directory the
volume was materialised in).  Nothing here touches the API server: the pod's ConfigMaps,
Secrets and service-account tokens come in as a ``PodRefs`` snapshot.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmpool_devcluster.kubelet_sa import token_key
from warmpool_devcluster.kwok import NODE_CAPACITY

Obj = Mapping[str, Any]

#: Names a kubelet accepts as environment variable names (C identifiers plus '.', '-').
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ContainerConfigError(Exception):
    """The container cannot be configured yet (a missing ConfigMap/Secret key, a bad field).

    A kubelet reports this as Waiting with reason ``CreateContainerConfigError`` and retries.
    """


@dataclass(frozen=True)
class PodRefs:
    """The ConfigMaps and Secrets a pod refers to, fetched once; None means it does not exist.

    Values are bytes (ConfigMap ``data`` encoded as UTF-8, ``binaryData`` and Secret data decoded).
    ``tokens`` holds the pod's service-account tokens by ``kubelet_sa.token_key``; a missing
    key means the token has not been issued.
    """

    config_maps: Mapping[str, Mapping[str, bytes] | None] = field(default_factory=dict)
    secrets: Mapping[str, Mapping[str, bytes] | None] = field(default_factory=dict)
    tokens: Mapping[str, bytes] = field(default_factory=dict)


def config_map_data(obj: Obj) -> dict[str, bytes]:
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def secret_data(obj: Obj) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
    return data


# --------------------------------------------------------------------------- $(VAR) expansion


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` like the kubelet: ``$$`` is a literal ``$``; unknown names stay as written."""
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:
                # An unclosed reference is kept literally, like the kubelet's expansion.
                out.append(text[i:])
                break
            name = text[i + 2 : close]
            if name and name in mapping:
                out.append(mapping[name])
            else:
                out.append(f"$({name})")
            i = close + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- fields and resources


def _bracket_key(path: str, prefix: str) -> str | None:
    match = re.fullmatch(re.escape(prefix) + r"\[['\"](.*)['\"]\]", path)
    return match.group(1) if match else None


def field_value(pod: Obj, path: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath``."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs") or [] if ip.get("ip")),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs") or [] if ip.get("ip")),
    }
    if path in simple:
        return str(simple[path] or "")
    if path in ("metadata.labels", "metadata.annotations"):
        values = meta.get(path.split(".", 1)[1]) or {}
        return "\n".join(f'{k}="{_quote(v)}"' for k, v in sorted(values.items()))
    for prefix in ("metadata.labels", "metadata.annotations"):
        key = _bracket_key(path, prefix)
        if key is not None:
            return str((meta.get(prefix.split(".", 1)[1]) or {}).get(key, ""))
    raise ContainerConfigError(f"unsupported fieldRef.fieldPath {path!r}")


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_SUFFIXES: dict[str, float] = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60,
}


def parse_quantity(text: str) -> float:
    """A Kubernetes resource quantity as a number ("500m" -> 0.5, "1Gi" -> 1073741824)."""
    number = r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)"
    match = re.fullmatch(number + r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)", str(text).strip())
    if not match:
        raise ContainerConfigError(f"cannot parse resource quantity {text!r}")
    return float(match.group(1)) * _SUFFIXES[match.group(2)]


def resource_value(container: Obj, ref: Obj) -> str:
    """A ``resourceFieldRef`` value: the limit (or request), node capacity when unset, ceil'd by divisor."""
    resource = str(ref.get("resource", ""))
    kind, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "limits":
        # A kubelet reports node allocatable for an unset limit.
        raw = NODE_CAPACITY.get(name)
    if raw is None:
        raw = "0"
    divisor = parse_quantity(str(ref.get("divisor") or "1"))
    return str(math.ceil(parse_quantity(str(raw)) / divisor))


# --------------------------------------------------------------------------- environment


def _lookup_key(
    store: Mapping[str, Mapping[str, bytes] | None], what: str, ref: Obj
) -> str | None:
    name = str(ref.get("name", ""))
    key = str(ref.get("key", ""))
    data = store.get(name)
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{what} "{name}" not found')
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f'couldn\'t find key {key} in {what} "{name}"')
    return data[key].decode(errors="replace")


def container_env(pod: Obj, container: Obj, refs: PodRefs) -> dict[str, str]:
    """The container's own environment (envFrom, then env in order with $(VAR) expansion)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        if "configMapRef" in source:
            store, what, ref = refs.config_maps, "configmap", source["configMapRef"]
        elif "secretRef" in source:
            store, what, ref = refs.secrets, "secret", source["secretRef"]
        else:
            continue
        data = store.get(str(ref.get("name", "")))
        if data is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f'{what} "{ref.get("name")}" not found')
        for key, raw in data.items():
            if _ENV_NAME.match(prefix + key):
                env[prefix + key] = raw.decode(errors="replace")
    for var in container.get("env") or []:
        name = str(var["name"])
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value") or ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, str(source["fieldRef"].get("fieldPath", "")))
        elif "resourceFieldRef" in source:
            value = resource_value(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = _lookup_key(refs.config_maps, "configmap", source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = _lookup_key(refs.secrets, "secret", source["secretKeyRef"])
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def referenced_objects(pod: Obj) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets the pod's env and volumes refer to."""
    config_maps: set[str] = set()
    secrets: set[str] = set()
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                config_maps.add(source["configMapRef"].get("name", ""))
            if "secretRef" in source:
                secrets.add(source["secretRef"].get("name", ""))
        for var in container.get("env") or []:
            value_from = var.get("valueFrom") or {}
            if "configMapKeyRef" in value_from:
                config_maps.add(value_from["configMapKeyRef"].get("name", ""))
            if "secretKeyRef" in value_from:
                secrets.add(value_from["secretKeyRef"].get("name", ""))
    for volume in spec.get("volumes") or []:
        if "configMap" in volume:
            config_maps.add(volume["configMap"].get("name", ""))
        if "secret" in volume:
            secrets.add(volume["secret"].get("secretName", ""))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                config_maps.add(source["configMap"].get("name", ""))
            if "secret" in source:
                secrets.add(source["secret"].get("name", ""))
    config_maps.discard("")
    secrets.discard("")
    return config_maps, secrets


# --------------------------------------------------------------------------- volume contents

#: One file of a volume: relative path -> (content, mode).
VolumeFiles = dict[str, tuple[bytes, int]]


def _key_files(
    data: Mapping[str, bytes] | None, source: Obj, what: str, default_mode: int, *, force_optional: bool
) -> VolumeFiles:
    name = source.get("name") or source.get("secretName") or ""
    if data is None:
        if source.get("optional") or force_optional:
            return {}
        raise ContainerConfigError(f'{what} "{name}" not found (volume)')
    files: VolumeFiles = {}
    items = source.get("items")
    if not items:
        for key, value in data.items():
            files[key] = (value, default_mode)
        return files
    for item in items:
        key = str(item["key"])
        if key not in data:
            if source.get("optional") or force_optional:
                continue
            raise ContainerConfigError(f'couldn\'t find key {key} in {what} "{name}" (volume)')
        files[str(item["path"])] = (data[key], int(item.get("mode", default_mode)))
    return files


def _downward_files(
    pod: Obj, container_by_name: Mapping[str, Obj], source: Obj, default_mode: int
) -> VolumeFiles:
    files: VolumeFiles = {}
    for item in source.get("items") or []:
        mode = int(item.get("mode", default_mode))
        if "fieldRef" in item:
            value = field_value(pod, str(item["fieldRef"].get("fieldPath", "")))
        elif "resourceFieldRef" in item:
            ref = item["resourceFieldRef"]
            container = container_by_name.get(str(ref.get("containerName", ""))) or {}
            value = resource_value(container, ref)
        else:
            continue
        files[str(item["path"])] = (value.encode(), mode)
    return files


#: A note for skipped projected sources, so the reason is visible next to the files.
SKIPPED_NOTE = ".warmpool-skipped"


def volume_files(pod: Obj, volume: Obj, refs: PodRefs) -> VolumeFiles | None:
    """The files a configMap/secret/downwardAPI/projected volume holds; None for other kinds.

    A projected ``serviceAccountToken`` source writes the token from ``refs.tokens``; one
    not issued yet holds the pod back, as a failed token mount does in a kubelet. The
    auto-injected ``kube-api-access-*`` volume tolerates a missing ``kube-root-ca.crt``
    ConfigMap rather than holding the pod back.
    """
    spec = pod.get("spec") or {}
    containers = {c["name"]: c for c in spec.get("containers") or []}
    if "configMap" in volume:
        src = volume["configMap"]
        mode = int(src.get("defaultMode", 0o644))
        data = refs.config_maps.get(src.get("name", ""))
        return _key_files(data, src, "configmap", mode, force_optional=False)
    if "secret" in volume:
        src = volume["secret"]
        mode = int(src.get("defaultMode", 0o644))
        data = refs.secrets.get(src.get("secretName", ""))
        return _key_files(data, src, "secret", mode, force_optional=False)
    if "downwardAPI" in volume:
        src = volume["downwardAPI"]
        return _downward_files(pod, containers, src, int(src.get("defaultMode", 0o644)))
    if "projected" in volume:
        src = volume["projected"]
        mode = int(src.get("defaultMode", 0o644))
        lenient = str(volume.get("name", "")).startswith("kube-api-access-")
        files: VolumeFiles = {}
        skipped: list[str] = []
        for source in src.get("sources") or []:
            if "configMap" in source:
                cm = source["configMap"]
                files.update(_key_files(refs.config_maps.get(cm.get("name", "")), cm, "configmap", mode,
                                        force_optional=lenient))
            elif "secret" in source:
                sec = source["secret"]
                files.update(_key_files(refs.secrets.get(sec.get("name", "")), sec, "secret", mode,
                                        force_optional=lenient))
            elif "downwardAPI" in source:
                files.update(_downward_files(pod, containers, source["downwardAPI"], mode))
            elif "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                token = refs.tokens.get(token_key(sat))
                if token is None:
                    raise ContainerConfigError(
                        f"no token issued yet for service account "
                        f"{spec.get('serviceAccountName') or 'default'!r} (see the kubelet's log)")
                # Owner-only whatever defaultMode says: no container isolation guards it here.
                files[str(sat.get("path") or "token")] = (token, mode & 0o600)
            else:
                skipped.extend(sorted(source))
        if skipped:
            note = "warmpool local kubelet skipped projected sources: " + ", ".join(skipped) + "\n"
            files[SKIPPED_NOTE] = (note.encode(), 0o644)
        return files
    return None


# --------------------------------------------------------------------------- mount paths


@dataclass(frozen=True)
class Mount:
    """A container path prefix and the local path that stands in for it."""

    mount_path: str
    local_path: str


def container_mounts(container: Obj, volume_paths: Mapping[str, Path]) -> list[Mount]:
    """The container's volumeMounts as local paths; mounts of unknown volumes are skipped."""
    mounts: list[Mount] = []
    for vm in container.get("volumeMounts") or []:
        base = volume_paths.get(str(vm.get("name", "")))
        if base is None:
            continue
        local = base
        sub = str(vm.get("subPath") or "")
        if sub:
            local = base / sub
        mounts.append(Mount(str(vm["mountPath"]).rstrip("/") or "/", str(local)))
    return mounts


#: Characters that continue a path component: a mount path only matches at a boundary.
_PATH_CHAR = r"[A-Za-z0-9._\-]"


def rewrite_paths(text: str, mounts: Sequence[Mount]) -> str:
    """Replace each mount path prefix in ``text`` with its local path.

    ``/data`` matches in ``/data``, ``/data/x`` and ``--dir=/data`` but not in ``/database``
    or ``/x/data``; the longest mount path wins, so nested mounts resolve to the inner one.
    """
    usable = [m for m in mounts if m.mount_path != "/"]
    if not usable or not text:
        return text
    by_path = {m.mount_path: m.local_path for m in usable}
    alternatives = "|".join(re.escape(p) for p in sorted(by_path, key=len, reverse=True))
    pattern = re.compile(rf"(?<![A-Za-z0-9._\-/])({alternatives})(?!{_PATH_CHAR})")
    return pattern.sub(lambda m: by_path[m.group(1)], text)


@dataclass(frozen=True)
class Launch:
    """What it takes to start one container as a local process (before PATH resolution)."""

    argv: list[str]
    env: dict[str, str]
    working_dir: str | None
    mounts: list[Mount]


def container_launch(pod: Obj, container: Obj, refs: PodRefs, volume_paths: Mapping[str, Path]) -> Launch:
    """Resolve a container's argv, env and working dir, with $(VAR) expanded and paths rewritten.

    Raises ``ContainerConfigError`` when a referenced ConfigMap/Secret key is missing.
    """
    mounts = container_mounts(container, volume_paths)
    env = {k: rewrite_paths(v, mounts) for k, v in container_env(pod, container, refs).items()}
    argv = [
        rewrite_paths(expand(str(part), env), mounts)
        for part in [*(container.get("command") or []), *(container.get("args") or [])]
    ]
    working_dir = container.get("workingDir")
    return Launch(argv, env, rewrite_paths(str(working_dir), mounts) if working_dir else None, mounts)
