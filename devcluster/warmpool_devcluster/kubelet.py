"""A local kubelet for the kwok fake nodes: runs each bound pod's containers as local processes.

kwok only gives a pod its loopback IP; this process does the rest a kubelet does: it
materialises volumes under ``<work-dir>/pods/<ns>/<pod>/volumes/``, starts each container's
``command``/``args`` (resolved on our own PATH; images are never pulled), probes them
(startup / readiness / liveness), restarts them with back-off, patches the pod's status
subresource, and on deletion stops the processes and removes the pod. Pods get their
ServiceAccount's bound token and a way for in-cluster clients to use it (``kubelet_sa``).

Run as ``python -m warmpool_devcluster.kubelet --kubeconfig PATH --work-dir DIR``; SIGTERM
or SIGINT stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from warmpool_devcluster.kubelet_probe import ProbeContext, ProbeKind, ProbeSpec, ProbeTracker, run_probe
from warmpool_devcluster.kubelet_proc import (
    ContainerProcess,
    container_log_path,
    kill_leftovers,
    pod_dir,
    resolve_command,
)
from warmpool_devcluster.kubelet_sa import (
    CA_FILE,
    TOKEN_FILE,
    PodTokens,
    container_sa_env,
    inherited_env,
    sa_kubeconfig,
    sa_kubeconfig_path,
    sa_volume,
)
from warmpool_devcluster.kubelet_spec import (
    ContainerConfigError,
    Launch,
    PodRefs,
    VolumeFiles,
    config_map_data,
    container_launch,
    expand,
    referenced_objects,
    rewrite_paths,
    secret_data,
    volume_files,
)
from warmpool_devcluster.kubelet_status import (
    COMMAND_NOT_RUNNABLE,
    CONFIG_ERROR,
    CRASH_LOOP,
    CREATING,
    ContainerRecord,
    build_status,
    exit_code,
    rfc3339,
)
from warmpool_devcluster.kwok import NODE_NAME_PREFIX

__all__ = ["container_log_path", "kill_leftovers", "main"]

log = logging.getLogger("warmpool.kubelet")
Obj = dict[str, Any]

#: Seconds a deleted-out-from-under-us pod's processes get between SIGTERM and SIGKILL.
ORPHAN_GRACE = 2.0
#: Seconds each process gets between SIGTERM and SIGKILL when the kubelet itself stops.
SHUTDOWN_GRACE = 3.0
#: Seconds between re-reads of the ConfigMaps/Secrets behind a pod's volumes.
REFRESH_PERIOD = 10.0
#: Retry delay while a pod's ConfigMaps/Secrets are missing (bounded, like the kubelet's sync).
CONFIG_RETRY = 2.0
#: Server-side watch timeout; the client read timeout is a little longer.
WATCH_TIMEOUT = 240


class Settings:
    """Knobs a test may want to turn; defaults match the kubelet's."""

    def __init__(
        self, backoff_base: float = 10.0, backoff_max: float = 300.0, node_prefix: str = NODE_NAME_PREFIX
    ) -> None:
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.node_prefix = node_prefix


def _meta(pod: Mapping[str, Any]) -> Obj:
    return dict(pod.get("metadata") or {})


def _pod_key(pod: Mapping[str, Any]) -> str:
    meta = _meta(pod)
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _grace_seconds(pod: Mapping[str, Any]) -> float:
    meta = _meta(pod)
    if meta.get("deletionGracePeriodSeconds") is not None:
        return float(meta["deletionGracePeriodSeconds"])
    value = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return float(30 if value is None else value)


class Backoff:
    """The kubelet's crash-loop back-off: first restart at once, then base, 2x base, ... capped.

    A container that ran for longer than twice the cap has its back-off reset.
    """

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0

    def next_delay(self, ran_for: float) -> float:
        if ran_for >= 2 * self.cap:
            self.failures = 0
        self.failures += 1
        if self.failures == 1:
            return 0.0
        return float(min(self.cap, self.base * 2 ** (self.failures - 2)))


async def _wait_any(*events: asyncio.Event, limit: float | None = None) -> None:
    """Return when any event is set, or after ``limit`` seconds."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class ContainerRunner:
    """One container: start, probe, restart with back-off, stop. Reports through its record."""

    def __init__(self, worker: PodWorker, container: Mapping[str, Any], *, init: bool = False) -> None:
        self.worker = worker
        self.container = container
        #: An init container runs to completion; it is retried only on failure.
        self.init = init
        self.name = str(container["name"])
        self.record = ContainerRecord(self.name, str(container.get("image") or ""))
        self.process: ContainerProcess | None = None
        self.stopping = asyncio.Event()
        self.kill_request = asyncio.Event()
        self.kill_reason = ""
        s = worker.kubelet.settings
        self.backoff = Backoff(s.backoff_base, s.backoff_max)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"container {self.worker.key}/{self.name}")

    def _changed(self) -> None:
        self.worker.status_dirty.set()

    def _wait_state(self, reason: str, message: str) -> None:
        if self.record.state.get("waiting") != {"reason": reason, "message": message}:
            log.info("%s/%s waiting: %s: %s", self.worker.key, self.name, reason, message)
        self.record.set_waiting(reason, message)
        self._changed()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s/%s: container loop failed", self.worker.key, self.name)
            self._wait_state(COMMAND_NOT_RUNNABLE, "internal error in the local kubelet; see its log")

    async def _loop(self) -> None:
        restart_policy = str((self.worker.pod.get("spec") or {}).get("restartPolicy") or "Always")
        while not self.stopping.is_set():
            if not self.container.get("command"):
                self._wait_state(
                    COMMAND_NOT_RUNNABLE,
                    "container has no command; image entrypoints are not available to the local kubelet",
                )
                return
            try:
                launch = container_launch(self.worker.pod, self.container, self.worker.refs,
                                          self.worker.volume_paths)
            except ContainerConfigError as error:
                self._wait_state(CONFIG_ERROR, str(error))
                await _wait_any(self.stopping, limit=CONFIG_RETRY)
                await self.worker.refresh_refs()
                continue
            env = {**inherited_env(os.environ), **self.worker.sa_env(self.container), **launch.env}
            executable = resolve_command(launch.argv[0], env.get("PATH"))
            if executable is None:
                self._wait_state(
                    COMMAND_NOT_RUNNABLE,
                    f"command {launch.argv[0]!r} is not an executable on the local kubelet's PATH",
                )
                return
            cwd = launch.working_dir or str(self.worker.pod_dir)
            if not Path(cwd).is_dir():  # noqa: ASYNC240 - a local stat, no I/O wait worth a thread
                self._wait_state(COMMAND_NOT_RUNNABLE, f"workingDir {cwd!r} does not exist on this machine")
                return
            try:
                w = self.worker
                self.process = await ContainerProcess.start(
                    [executable, *launch.argv[1:]], env, cwd,
                    container_log_path(w.work_dir, w.namespace, w.name, self.name),
                    w.work_dir, f"{w.namespace}.{w.name}.{self.name}",
                )
            except OSError as error:
                self._wait_state(COMMAND_NOT_RUNNABLE, f"cannot start {launch.argv[0]!r}: {error}")
                return
            process = self.process
            if self.stopping.is_set():
                return  # stop() takes the process down
            log.info("%s/%s started pid %d: %s", self.worker.key, self.name, process.pid, launch.argv)
            self.record.set_running(process.started_at, f"warmpool://{process.pid}")
            self.kill_request.clear()
            self._changed()
            probes = asyncio.create_task(self._probe(process, launch, env, cwd))
            exited = asyncio.ensure_future(process.wait())
            stop_waiter = asyncio.ensure_future(self.stopping.wait())
            kill_waiter = asyncio.ensure_future(self.kill_request.wait())
            try:
                await asyncio.wait([exited, stop_waiter, kill_waiter], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pending in (probes, stop_waiter, kill_waiter):
                    pending.cancel()
                await asyncio.gather(probes, stop_waiter, kill_waiter, return_exceptions=True)
            if self.stopping.is_set():
                exited.cancel()  # stop() takes the process down
                return
            if not exited.done():
                log.info("%s/%s: %s; killing it", self.worker.key, self.name, self.kill_reason)
                await process.stop(_grace_seconds(self.worker.pod))
            code = await exited
            finished_at = time.time()
            self.process = None
            if self.init:
                restart = code != 0 and restart_policy != "Never"
            else:
                restart = restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0)
            log.info("%s/%s exited with code %d (restart: %s)",
                     self.worker.key, self.name, exit_code(code), restart)
            self.record.set_terminated(code, process.started_at, finished_at, final=not restart)
            self._changed()
            if not restart:
                return
            delay = self.backoff.next_delay(finished_at - process.started_at)
            if delay > 0:
                self._wait_state(
                    CRASH_LOOP,
                    f"back-off {delay:.0f}s restarting failed container={self.name} pod={self.worker.name}",
                )
                await _wait_any(self.stopping, limit=delay)

    async def _probe(
        self, process: ContainerProcess, launch: Launch, env: Mapping[str, str], cwd: str
    ) -> None:
        pod_ip = str((self.worker.pod.get("status") or {}).get("podIP") or "127.0.0.1")
        ctx = ProbeContext(pod_ip, self.container, env, cwd, self.worker.kubelet.session)
        specs: dict[ProbeKind, ProbeSpec] = {}
        for kind in ("startup", "readiness", "liveness"):
            probe = self.container.get(f"{kind}Probe")
            if probe:
                specs[kind] = ProbeSpec.from_k8s(probe, kind)

        def exec_argv(spec: ProbeSpec) -> list[str]:
            raw = [str(a) for a in spec.action.get("command") or []] if spec.handler == "exec" else []
            return [rewrite_paths(expand(a, launch.env), launch.mounts) for a in raw]

        async def attempts(kind: ProbeKind, on_result: Callable[[bool | None, str], Awaitable[bool]]) -> None:
            spec = specs[kind]
            tracker = ProbeTracker(spec, kind)
            await asyncio.sleep(max(0.0, process.started_at + spec.initial_delay - time.time()))
            argv = exec_argv(spec)
            while True:
                began = time.monotonic()
                ok, message = await run_probe(spec, ctx, argv)
                result = tracker.observe(ok)
                # Log the first failure of a run and the one that crosses the threshold, not every one.
                if not ok and tracker.failures in (1, spec.failure_threshold):
                    log.info("%s/%s %s probe failed (%d in a row): %s",
                             self.worker.key, self.name, kind, tracker.failures, message)
                if await on_result(result, message):
                    return
                await asyncio.sleep(max(0.0, spec.period - (time.monotonic() - began)))

        async def on_startup(result: bool | None, message: str) -> bool:
            if result is False:
                self._kill(f"startup probe failed: {message}")
                return True
            return result is True

        async def on_readiness(result: bool | None, message: str) -> bool:
            if bool(result) != self.record.ready:
                self.record.ready = bool(result)
                log.info("%s/%s ready=%s (%s)", self.worker.key, self.name, self.record.ready, message)
                self._changed()
            return False

        async def on_liveness(result: bool | None, message: str) -> bool:
            if result is False:
                self._kill(f"liveness probe failed: {message}")
                return True
            return False

        if "startup" in specs:
            await attempts("startup", on_startup)
        self.record.started = True
        if "readiness" not in specs:
            self.record.ready = True
        self._changed()
        loops = []
        if "readiness" in specs:
            loops.append(attempts("readiness", on_readiness))
        if "liveness" in specs:
            loops.append(attempts("liveness", on_liveness))
        await asyncio.gather(*loops)

    def _kill(self, reason: str) -> None:
        self.kill_reason = reason
        self.kill_request.set()

    async def stop(self, grace: float) -> None:
        """Stop the loop and the process (SIGTERM, ``grace`` seconds, SIGKILL)."""
        self.stopping.set()
        if self.task is not None:
            try:
                async with asyncio.timeout(5):
                    await asyncio.shield(self.task)
            except (TimeoutError, asyncio.CancelledError):
                self.task.cancel()
        process, self.process = self.process, None
        if process is not None:
            code = await process.stop(grace)
            self.record.set_terminated(code, process.started_at, time.time(), final=True)


class PodWorker:
    """Everything for one pod (by UID): sandbox, volumes, container runners, status, deletion."""

    def __init__(self, kubelet: Kubelet, pod: Obj) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = _meta(pod)
        self.uid = str(meta["uid"])
        self.namespace = str(meta["namespace"])
        self.name = str(meta["name"])
        self.key = f"{self.namespace}/{self.name}"
        self.work_dir = kubelet.work_dir
        self.pod_dir = pod_dir(self.work_dir, self.namespace, self.name)
        self.refs = PodRefs()
        self.tokens = PodTokens(kubelet.request_token)
        self.volume_paths: dict[str, Path] = {}
        self.written: dict[str, VolumeFiles] = {}
        self.updated = asyncio.Event()
        self.status_dirty = asyncio.Event()
        self.removed = False
        self.sandbox_ready = False
        status = pod.get("status") or {}
        self.start_time = str(status.get("startTime") or rfc3339(time.time()))
        self.last_status: Obj | None = None
        spec = pod.get("spec") or {}
        # Sidecar-style init containers (restartPolicy: Always) run beside the others.
        inits = spec.get("initContainers") or []
        self.init_runners = [ContainerRunner(self, c, init=True) for c in inits if c.get("restartPolicy") != "Always"]
        self.runners = [ContainerRunner(self, c) for c in inits if c.get("restartPolicy") == "Always"]
        self.runners += [ContainerRunner(self, c) for c in spec.get("containers") or []]
        # After a kubelet restart the processes are new, but restart counts must not go back.
        previous = {c.get("name"): c for c in status.get("containerStatuses") or []}
        for runner in self.runners:
            runner.record.restart_count = int((previous.get(runner.name) or {}).get("restartCount") or 0)
            if self.init_runners:
                runner.record.set_waiting("PodInitializing")
        self.task = asyncio.create_task(self._run(), name=f"pod {self.key}")

    # ------------------------------------------------------------------ inputs
    def update(self, pod: Obj) -> None:
        self.pod = pod
        self.updated.set()

    def gone(self) -> None:
        self.removed = True
        self.updated.set()

    def _deleting(self) -> bool:
        return bool(_meta(self.pod).get("deletionTimestamp"))

    # ------------------------------------------------------------------ main flow
    async def _run(self) -> None:
        try:
            await self._lifecycle()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: pod worker failed", self.key)
        finally:
            await self._stop_all(ORPHAN_GRACE)
            if self.removed:
                # The pod is gone for good: drop its volumes (secrets among them), keep the logs.
                shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)
            self.kubelet.forget(self)

    async def _lifecycle(self) -> None:
        # kwok's stage gives the pod its loopback IP; nothing runs before that.
        while not (self.pod.get("status") or {}).get("podIP"):
            if self.removed or self._deleting():
                break
            self.updated.clear()
            await self.updated.wait()
        if not self.removed and not self._deleting():
            await self._prepare_sandbox()
            if self.removed or self._deleting():
                pass
            else:
                helpers = [asyncio.create_task(self._start_containers()),
                           asyncio.create_task(self._refresh_volumes())]
                try:
                    await self._serve()
                finally:
                    for helper in helpers:
                        helper.cancel()
                    await asyncio.gather(*helpers, return_exceptions=True)
        if self.removed:
            return
        if self._deleting():
            await self._terminate()

    async def _start_containers(self) -> None:
        """Init containers one at a time, each to success; then all the others together."""
        for runner in self.init_runners:
            runner.start()
            assert runner.task is not None
            await asyncio.shield(runner.task)
            if runner.record.exit_code() != 0:
                return  # failed for good (restartPolicy Never) or never runnable: the pod stays put
        for runner in self.runners:
            runner.start()

    async def _serve(self) -> None:
        """Patch status whenever a runner reports a change, until the pod is deleted or removed."""
        self.status_dirty.set()
        while not self.removed and not self._deleting():
            await _wait_any(self.updated, self.status_dirty)
            self.updated.clear()
            if self.removed or self._deleting():
                return
            if self.status_dirty.is_set():
                self.status_dirty.clear()
                if not await self._sync_status():
                    await _wait_any(self.updated, limit=1.0)
                    self.status_dirty.set()

    async def _terminate(self) -> None:
        grace = _grace_seconds(self.pod)
        log.info("%s: deleting (grace %.0fs)", self.key, grace)
        await self._stop_all(grace)
        await self._sync_status()
        await self.kubelet.delete_pod(self.namespace, self.name, self.uid)

    async def _stop_all(self, grace: float) -> None:
        runners = [*self.init_runners, *self.runners]
        await asyncio.gather(*(r.stop(grace) for r in runners), return_exceptions=True)

    # ------------------------------------------------------------------ status
    async def _sync_status(self) -> bool:
        """Patch the status subresource if it changed; False when the patch should be retried."""
        if self.removed:
            return True
        status = build_status(self.pod, [r.record for r in self.runners], sandbox_ready=self.sandbox_ready,
                              start_time=self.start_time, now=time.time(),
                              init_records=[r.record for r in self.init_runners])
        if status == self.last_status:
            return True
        try:
            patched = await self.kubelet.patch_status(self.namespace, self.name, status)
        except ApiException as error:
            if error.status == 404:
                return True
            log.warning("%s: status patch failed: %s %s", self.key, error.status, error.reason)
            return False
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            log.warning("%s: status patch failed: %s", self.key, error)
            return False
        self.last_status = status
        if patched is not None and _meta(patched).get("uid") == self.uid:
            # Keep our view of conditions current so lastTransitionTime stays stable.
            self.pod = {**self.pod, "status": patched.get("status") or {}}
        return True

    # ------------------------------------------------------------------ volumes
    async def refresh_refs(self) -> None:
        config_maps, secrets = referenced_objects(self.pod)
        refs = await self.kubelet.fetch_refs(self.namespace, config_maps, secrets)
        self.refs = PodRefs(refs.config_maps, refs.secrets, await self.tokens.fetch(self.pod))

    def sa_env(self, container: Mapping[str, Any]) -> dict[str, str]:
        return container_sa_env(container, self.kubelet.server, self.pod_dir, self.written)

    def _write_kubeconfigs(self) -> None:
        """(Re)write the kubeconfig of each token volume mounted at the service-account path."""
        spec = self.pod.get("spec") or {}
        containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        for volume in {v for v in map(sa_volume, containers) if v is not None}:
            files = self.written.get(volume) or {}
            token = files.get(TOKEN_FILE)
            if token is None or volume not in self.volume_paths:
                continue
            text = yaml.safe_dump(sa_kubeconfig(self.kubelet.server, self.volume_paths[volume], token[0],
                                                self.namespace, CA_FILE in files))
            path = sa_kubeconfig_path(self.pod_dir, volume)
            if path.is_file() and path.read_text() == text:
                continue
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            tmp.chmod(0o600)  # it holds the token
            os.replace(tmp, path)

    async def _prepare_sandbox(self) -> None:
        """Fresh per-pod directory (a new UID under a reused name starts empty), then volumes."""
        uid_file = self.pod_dir / ".uid"
        if self.pod_dir.is_dir() and (not uid_file.is_file() or uid_file.read_text() != self.uid):
            shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)
            for old_log in self.pod_dir.glob("*.log"):
                old_log.unlink()
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        uid_file.write_text(self.uid)
        while not self.removed and not self._deleting():
            await self.refresh_refs()
            try:
                self._materialize()
            except ContainerConfigError as error:
                for runner in [*self.init_runners, *self.runners]:
                    runner.record.set_waiting(CREATING, f"volume not ready: {error}")
                await self._sync_status()
                self.updated.clear()
                await _wait_any(self.updated, limit=CONFIG_RETRY)
                continue
            self.sandbox_ready = True
            return

    def _materialize(self) -> None:
        base = self.pod_dir / "volumes"
        for volume in (self.pod.get("spec") or {}).get("volumes") or []:
            name = str(volume["name"])
            if "hostPath" in volume:
                host = volume["hostPath"]
                path = Path(str(host["path"]))
                if host.get("type") == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                self.volume_paths[name] = path
                continue
            target = base / name
            target.mkdir(parents=True, exist_ok=True)
            self.volume_paths[name] = target
            files = volume_files(self.pod, volume, self.refs)
            if files is None:
                if "emptyDir" not in volume:
                    log.warning("%s: volume %s of an unsupported kind is an empty directory", self.key, name)
                continue
            self._write_files(name, target, files)
        self._write_kubeconfigs()

    def _write_files(self, name: str, target: Path, files: VolumeFiles) -> bool:
        """Write changed files atomically and drop vanished ones; True if anything changed."""
        previous = self.written.get(name, {})
        changed = False
        for rel, (content, mode) in files.items():
            if previous.get(rel) == (content, mode):
                continue
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(content)
            tmp.chmod(mode & 0o777)  # os.replace needs the directory writable, not the file
            os.replace(tmp, path)
            changed = True
        for rel in set(previous) - set(files):
            with contextlib.suppress(FileNotFoundError):
                (target / rel).unlink()
            changed = True
        self.written[name] = dict(files)
        return changed

    async def _refresh_volumes(self) -> None:
        """Re-read ConfigMaps/Secrets behind volumes, as a kubelet's periodic sync does."""
        volumes = [v for v in (self.pod.get("spec") or {}).get("volumes") or []
                   if {"configMap", "secret", "projected"} & set(v)]
        if not volumes:
            return
        while True:
            await asyncio.sleep(REFRESH_PERIOD)
            try:
                await self.refresh_refs()
                for volume in volumes:
                    name = str(volume["name"])
                    try:
                        files = volume_files(self.pod, volume, self.refs)
                    except ContainerConfigError:
                        continue  # keep the last good contents, as a kubelet does
                    if files is not None and self._write_files(name, self.volume_paths[name], files):
                        log.info("%s: volume %s refreshed", self.key, name)
                self._write_kubeconfigs()
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as error:
                log.warning("%s: volume refresh failed: %s", self.key, error)


class Kubelet:
    """Watches pods bound to our fake nodes and keeps one PodWorker per pod UID."""

    def __init__(self, api: client.CoreV1Api, session: aiohttp.ClientSession, work_dir: Path,
                 settings: Settings, server: str) -> None:
        # Every call uses _preload_content=False (raw JSON dicts, status checked here), which
        # the client's typed signatures do not model: hence Any.
        self.api: Any = api
        self.session = session
        self.work_dir = work_dir
        self.settings = settings
        #: The API server's URL (from our kubeconfig), handed to pods' in-cluster clients.
        self.server = server
        self.workers: dict[str, PodWorker] = {}

    def _ours(self, pod: Mapping[str, Any]) -> bool:
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        return node.startswith(self.settings.node_prefix)

    def dispatch(self, pod: Obj) -> None:
        uid = str(_meta(pod).get("uid"))
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(pod)
        elif self._ours(pod) and (
            (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            or _meta(pod).get("deletionTimestamp")
        ):
            log.info("%s: new pod on %s", _pod_key(pod), (pod.get("spec") or {}).get("nodeName"))
            self.workers[uid] = PodWorker(self, pod)

    def removed(self, uid: str) -> None:
        worker = self.workers.get(uid)
        if worker is not None:
            log.info("%s: pod object is gone", worker.key)
            worker.gone()

    def forget(self, worker: PodWorker) -> None:
        if self.workers.get(worker.uid) is worker:
            del self.workers[worker.uid]

    # ------------------------------------------------------------------ API calls
    async def patch_status(self, namespace: str, name: str, status: Obj) -> Obj | None:
        response = await self.api.patch_namespaced_pod_status(
            name, namespace, {"status": status}, _preload_content=False,
            _content_type="application/strategic-merge-patch+json", _request_timeout=30,
        )
        body = await response.read()
        if response.status >= 300:
            raise ApiException(status=response.status, reason=body.decode(errors="replace")[:300])
        result: Obj = json.loads(body)
        return result

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        try:
            await self.api.delete_namespaced_pod(name, namespace, body=body, grace_period_seconds=0,
                                                 _request_timeout=30)
        except ApiException as error:
            if error.status not in (404, 409):
                log.warning("%s/%s: delete failed: %s %s", namespace, name, error.status, error.reason)

    async def request_token(self, service_account: str, namespace: str, body: Obj) -> Obj:
        """TokenRequest for a pod's ServiceAccount (we are in system:masters, so allowed)."""
        response = await self.api.create_namespaced_service_account_token(
            service_account, namespace, body, _preload_content=False, _request_timeout=30,
        )
        data = await response.read()
        if response.status >= 300:
            raise ApiException(status=response.status, reason=data.decode(errors="replace")[:300])
        result: Obj = json.loads(data)
        return result

    async def _read(self, call: Callable[..., Awaitable[Any]], name: str, namespace: str) -> Obj | None:
        response = await call(name, namespace, _preload_content=False, _request_timeout=30)
        body = await response.read()
        if response.status == 404:
            return None
        if response.status >= 300:
            raise ApiException(status=response.status, reason=body.decode(errors="replace")[:300])
        result: Obj = json.loads(body)
        return result

    async def fetch_refs(self, namespace: str, config_maps: set[str], secrets: set[str]) -> PodRefs:
        cms: dict[str, Mapping[str, bytes] | None] = {}
        secs: dict[str, Mapping[str, bytes] | None] = {}
        for name in sorted(config_maps):
            obj = await self._read(self.api.read_namespaced_config_map, name, namespace)
            cms[name] = None if obj is None else config_map_data(obj)
        for name in sorted(secrets):
            obj = await self._read(self.api.read_namespaced_secret, name, namespace)
            secs[name] = None if obj is None else secret_data(obj)
        return PodRefs(cms, secs)

    # ------------------------------------------------------------------ list + watch
    async def _list(self) -> str:
        response = await self.api.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=", _preload_content=False, _request_timeout=60,
        )
        body = await response.read()
        if response.status >= 300:
            raise ApiException(status=response.status, reason=body.decode(errors="replace")[:300])
        data = json.loads(body)
        seen = set()
        for pod in data.get("items") or []:
            seen.add(str(_meta(pod).get("uid")))
            self.dispatch(pod)
        for uid in set(self.workers) - seen:
            self.removed(uid)
        return str(data["metadata"]["resourceVersion"])

    async def _watch(self, resource_version: str) -> str | None:
        """Follow one watch; return the last resourceVersion, or None when a re-list is needed."""
        response = await self.api.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=", watch=True, resource_version=resource_version,
            allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT, _preload_content=False,
            _request_timeout=(10, WATCH_TIMEOUT + 30),
        )
        try:
            if response.status == 410:
                return None
            if response.status >= 300:
                body = await response.read()
                raise ApiException(status=response.status, reason=body.decode(errors="replace")[:300])
            buffer = b""
            # Split lines ourselves: StreamReader.readline caps line length, pods can be large.
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        next_version = self._event(json.loads(line), resource_version)
                        if next_version is None:
                            return None
                        resource_version = next_version
            return resource_version
        finally:
            response.release()

    def _event(self, event: Obj, resource_version: str) -> str | None:
        """Apply one watch event; the new resourceVersion, or None when a re-list is needed."""
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                return None
            raise ApiException(status=obj.get("code") or 500, reason=str(obj.get("message")))
        resource_version = str(_meta(obj).get("resourceVersion") or resource_version)
        if kind in ("ADDED", "MODIFIED"):
            self.dispatch(obj)
        elif kind == "DELETED":
            self.removed(str(_meta(obj).get("uid")))
        return resource_version

    async def run(self) -> None:
        delay = 1.0
        while True:
            try:
                resource_version: str | None = await self._list()
                log.info("listed pods at resourceVersion %s (%d ours)", resource_version, len(self.workers))
                delay = 1.0
                while resource_version is not None:
                    resource_version = await self._watch(resource_version)
                log.info("watch expired (410 Gone); re-listing")
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                log.warning("pod list/watch failed: %s; retrying in %.0fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def shutdown(self) -> None:
        workers = list(self.workers.values())
        for worker in workers:
            worker.task.cancel()
        await asyncio.gather(*(w.task for w in workers), return_exceptions=True)
        await asyncio.gather(*(w._stop_all(SHUTDOWN_GRACE) for w in workers), return_exceptions=True)


async def _amain(args: argparse.Namespace, work_dir: Path) -> int:
    leftovers = kill_leftovers(work_dir)
    if leftovers:
        log.info("killed %d process groups left by an earlier kubelet", leftovers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api_client = await config.new_client_from_config(config_file=str(args.kubeconfig))
    settings = Settings(args.backoff_base, args.backoff_max, args.node_prefix)
    connector = aiohttp.TCPConnector(force_close=True)  # probes open a fresh connection, like a kubelet's
    async with api_client, aiohttp.ClientSession(connector=connector) as session:
        kubelet = Kubelet(client.CoreV1Api(api_client), session, work_dir, settings,
                          str(api_client.configuration.host))
        runner = asyncio.create_task(kubelet.run())
        log.info("local kubelet serving nodes %s* (work dir %s)", settings.node_prefix, work_dir)
        await stop.wait()
        log.info("stopping: terminating %d pods' processes", len(kubelet.workers))
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await kubelet.shutdown()
    left = kill_leftovers(work_dir)
    if left:
        log.warning("killed %d stray process groups on the way out", left)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m warmpool_devcluster.kubelet", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--node-prefix", default=NODE_NAME_PREFIX, help="serve pods on nodes named so")
    parser.add_argument("--backoff-base", type=float, default=10.0, help="crash-loop back-off start (s)")
    parser.add_argument("--backoff-max", type=float, default=300.0, help="crash-loop back-off cap (s)")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("aiohttp").setLevel(logging.WARNING)
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_amain(args, work_dir))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
