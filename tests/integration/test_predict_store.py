"""The request history in a ConfigMap the WarmModel owns, against the real API server.

A store writes a day of history built from the shared Azure trace; a new store on a new API
client (a restarted operator) loads exactly the same history.  A ConfigMap of that name the
WarmModel does not own is left byte-for-byte intact; garbage in our own ConfigMap falls back to
an empty history with the reason, and is then overwritten.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config
from warmpool_bench.predict_trace import load_trace, repeat
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.io.history_store import (
    COMPONENT_HISTORY,
    CONFIGMAP_KEY_HISTORY,
    HistoryStore,
    StoreSettings,
    history_configmap_name,
)
from warmpool_operator.io.kube import Kube
from warmpool_operator.rules.forecast.history import History, HistoryLimits, StepObservation, dumps
from warmpool_operator.rules.forecast.lengths import histogram

from tests.support.e2e import warmmodel
from warmpool.contract.api import KIND
from warmpool.contract.pods import LABEL_COMPONENT, LABEL_MANAGED_BY

pytestmark = pytest.mark.integration

TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "azure-llm-trace-2023" / "code.csv"
LIMITS = HistoryLimits()


def _trace_history() -> History:
    """About a day of 60 s steps: the shared trace (57 min) played 24 times, binned like the operator bins it."""
    if not TRACE.is_file():
        pytest.skip(f"the shared Azure trace is not at {TRACE}")
    trace = repeat(load_trace(TRACE), 24)
    first_step = int(trace.epoch_start) // LIMITS.step_s
    per_step: dict[int, list[tuple[int, int]]] = {}
    for request in trace.requests:
        step = int(trace.epoch_start + request.t) // LIMITS.step_s
        per_step.setdefault(step, []).append((request.prompt, request.generated))
    history = History(limits=LIMITS)
    for step in range(first_step, max(per_step) + 1):
        seen = per_step.get(step, [])
        history.record(step, StepObservation(
            requests=len(seen), prompt_tokens=sum(p for p, _ in seen), generated_tokens=sum(g for _, g in seen),
            prompt_lengths=tuple(histogram(p for p, _ in seen)),
            generated_lengths=tuple(histogram(g for _, g in seen))))
    return history


@pytest.fixture()
def owner(cluster: ClusterHandle, crd: str, namespace: str) -> Iterator[dict[str, Any]]:
    """A real WarmModel (no operator runs: nothing else touches its objects)."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    input=json.dumps(warmmodel("hist", Path("/nonexistent/model"))))
    body: dict[str, Any] = json.loads(cluster.kubectl("get", "-n", namespace, "warmmodel", "hist", "-o",
                                                      "json").stdout)
    yield body


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def _with_store(cluster: ClusterHandle, owner: dict[str, Any], action: Any,
                      settings: StoreSettings | None = None) -> Any:
    """A store on an API client of its own (each call is a fresh operator process, as far as it knows)."""
    kube = Kube(await config.new_client_from_config(config_file=str(cluster.kubeconfig)))
    try:
        return await action(HistoryStore(kube, owner, LIMITS, settings))
    finally:
        await kube.close()


def _configmap(cluster: ClusterHandle, namespace: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", "-n", namespace, "configmap", history_configmap_name("hist"), "-o", "json",
                           "--show-managed-fields", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def test_a_restarted_operator_loads_exactly_the_history_it_wrote(
    cluster: ClusterHandle, owner: dict[str, Any], namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    history = _trace_history()
    assert len(history) > 22 * 60 and sum(history.requests) > 100_000  # about a day of real arrivals

    async def first_life(store: HistoryStore) -> tuple[Any, ...]:
        loaded = await store.load()
        written = await store.save(history)
        again = await store.save(history)  # inside the interval
        forced = await store.save(history, force=True)  # due, but the same content
        return loaded, written, again, forced

    with caplog.at_level(logging.INFO, logger="warmpool.operator"):
        loaded, written, again, forced = _run(_with_store(cluster, owner, first_life))
    assert len(loaded.history) == 0 and "no stored history" in (loaded.reason or "")
    assert written.written and written.dropped_steps == 0, written
    assert (again.written, again.reason) == (False, "not due")
    assert (forced.written, forced.reason) == (False, "unchanged")

    stored = _configmap(cluster, namespace)
    assert stored is not None
    meta = stored["metadata"]
    assert [(r["kind"], r["uid"], r.get("controller")) for r in meta["ownerReferences"]] == [
        (KIND, owner["metadata"]["uid"], True)]
    assert meta["labels"][LABEL_COMPONENT] == COMPONENT_HISTORY
    assert LABEL_MANAGED_BY not in meta["labels"]
    assert len(stored["data"][CONFIGMAP_KEY_HISTORY]) < StoreSettings().max_bytes
    print(f"a day of the Azure trace: {len(history)} steps, {sum(history.requests)} requests, "
          f"{len(stored['data'][CONFIGMAP_KEY_HISTORY])} bytes stored")

    async def second_life(store: HistoryStore) -> Any:
        return await store.load()

    reloaded = _run(_with_store(cluster, owner, second_life))
    assert reloaded.reason is None
    again_history = reloaded.history
    assert dumps(again_history) == dumps(history)
    assert (again_history.start, again_history.requests, again_history.prompt_tokens,
            again_history.generated_tokens) == (history.start, history.requests, history.prompt_tokens,
                                                history.generated_tokens)
    assert again_history.prompt_histogram() == history.prompt_histogram()
    assert again_history.generated_histogram() == history.generated_histogram()

    # later writes are server-side applies by the operator's field manager
    history.record(history.end, StepObservation(requests=3))

    async def third_life(store: HistoryStore) -> Any:
        await store.load()
        return await store.save(history)

    assert _run(_with_store(cluster, owner, third_life)).written
    stored = _configmap(cluster, namespace)
    assert stored is not None
    assert any(f["manager"] == "warmpool-operator" and f["operation"] == "Apply"
               for f in stored["metadata"]["managedFields"])
    assert _run(_with_store(cluster, owner, second_life)).history.requests[-1] == 3


@pytest.mark.parametrize("owned_by", ["nobody", "another WarmModel"])
def test_a_foreign_configmap_of_that_name_is_left_byte_for_byte(
    cluster: ClusterHandle, owner: dict[str, Any], namespace: str, owned_by: str
) -> None:
    meta: dict[str, Any] = {"name": history_configmap_name("hist"), "namespace": namespace,
                            "labels": {"team": "theirs"}}
    if owned_by != "nobody":  # an owner reference of our kind, another uid (a real owner: else the GC deletes it)
        cluster.kubectl("apply", "-n", namespace, "-f", "-",
                        input=json.dumps(warmmodel("other", Path("/nonexistent/model"))))
        other = json.loads(cluster.kubectl("get", "-n", namespace, "warmmodel", "other", "-o", "json").stdout)
        meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": KIND, "name": "other",
                                    "uid": other["metadata"]["uid"]}]
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
               "data": {CONFIGMAP_KEY_HISTORY: "their own notes", "other": "x"}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(foreign))
    before = _configmap(cluster, namespace)
    history = _trace_history()

    async def life(store: HistoryStore) -> tuple[Any, Any]:
        loaded = await store.load()
        return loaded, await store.save(history, force=True)

    loaded, saved = _run(_with_store(cluster, owner, life))
    assert len(loaded.history) == 0 and "is not owned by WarmModel hist" in (loaded.reason or "")
    assert not saved.written and "not owned" in saved.reason
    assert _configmap(cluster, namespace) == before  # resourceVersion, data, labels: all as they were


def test_garbage_in_our_configmap_falls_back_to_empty_with_the_reason(
    cluster: ClusterHandle, owner: dict[str, Any], namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    history = _trace_history()

    async def write(store: HistoryStore) -> Any:
        await store.load()
        return await store.save(history)

    assert _run(_with_store(cluster, owner, write)).written
    name = history_configmap_name("hist")
    cluster.kubectl("patch", "-n", namespace, "configmap", name, "--type=merge",
                    "-p", json.dumps({"data": {CONFIGMAP_KEY_HISTORY: "wph1.@@not base64@@"}}))

    async def restart(store: HistoryStore) -> tuple[Any, Any]:
        loaded = await store.load()
        return loaded, await store.save(history)

    with caplog.at_level(logging.WARNING, logger="warmpool.operator"):
        loaded, saved = _run(_with_store(cluster, owner, restart))
    assert len(loaded.history) == 0
    assert "stored history refused: history is not valid base64" in (loaded.reason or "")
    assert any("not valid base64" in record.getMessage() and "starts empty" in record.getMessage()
               for record in caplog.records)
    # ours, so the next save replaces the garbage with a history that loads
    assert saved.written
    stored = _configmap(cluster, namespace)
    assert stored is not None and stored["data"][CONFIGMAP_KEY_HISTORY] == dumps(history)
