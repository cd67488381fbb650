"""An operator upgrade reads the history its predecessor stored: a week of single-resolution 60 s
steps in the WarmModel's ConfigMap, on a real API server (no controllers, no node), is loaded at the
new limits (fine steps at the default step, a coarse tier of 5 min steps) with the week in the coarse
tier, written back at the new limits by the next save, and loaded whole by the operator after it."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.control.forecasting import limits_for
from warmpool_operator.io.history_store import CONFIGMAP_KEY_HISTORY, HistoryStore, history_configmap_name
from warmpool_operator.io.kube import CONFIGMAPS, Kube
from warmpool_operator.rules.forecast.history import MISSING, History, HistoryLimits, StepObservation, dumps, loads
from warmpool_operator.rules.forecast.lengths import histogram
from warmpool_operator.settings import OperatorConfig

from tests.support.e2e import warmmodel
from warmpool.contract.api import API_GROUP_VERSION, KIND

pytestmark = pytest.mark.integration

FIRST_STEP = 20_000 * 1440  # a 60 s step index on a whole day


def _old_operators_week() -> History:
    """What the previous operator stored: 10,080 steps of 60 s (one resolution), lengths per hour."""
    history = History(limits=HistoryLimits(step_s=60, retention_s=60 * 7 * 1440, slot_s=3600))
    for k in range(7 * 1440):
        busy = 9 * 60 <= k % 1440 < 17 * 60  # office hours
        history.record(FIRST_STEP + k, StepObservation(
            requests=40 if busy else 3, prompt_tokens=(40 if busy else 3) * 900,
            prompt_lengths=tuple(histogram([900] * (40 if busy else 3)))))
    return history


def _kubectl_json(server: ClusterHandle, *args: str) -> dict[str, Any]:
    return dict(json.loads(server.kubectl(*args, "-o", "json").stdout))


def test_an_upgraded_operator_keeps_the_week_its_predecessor_stored(
    api_server: ClusterHandle, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"history-upgrade-{uuid.uuid4().hex[:6]}"
    api_server.kubectl("create", "namespace", namespace)
    api_server.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(warmmodel("wk", Path("/nonexistent"))))
    owner = _kubectl_json(api_server, "get", "-n", namespace, "warmmodel", "wk")
    old = _old_operators_week()
    api_server.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": history_configmap_name("wk"), "ownerReferences": [{
            "apiVersion": API_GROUP_VERSION, "kind": KIND, "name": "wk", "uid": owner["metadata"]["uid"],
            "controller": True}]},
        "data": {CONFIGMAP_KEY_HISTORY: dumps(old)},
    }))
    limits = limits_for(OperatorConfig().predict_step_seconds)  # the new operator's default: 30 s, and 5 min

    async def lives() -> tuple[Any, ...]:
        kube = Kube(await config.new_client_from_config(config_file=str(api_server.kubeconfig)))
        try:
            upgraded = HistoryStore(kube, owner, limits)
            loaded = await upgraded.load()
            history = loaded.history
            history.record(old.end * 2, StepObservation(requests=5))  # the new operator's first 30 s step
            saved = await upgraded.save(history, force=True)
            stored = (await kube.get(CONFIGMAPS, namespace, history_configmap_name("wk")) or {})["data"]
            again = await HistoryStore(kube, owner, limits).load()  # the operator after it: as it is
            return loaded, saved, stored[CONFIGMAP_KEY_HISTORY], again, history
        finally:
            await kube.close()

    caplog.set_level(logging.INFO, logger="warmpool.operator")
    try:
        loaded, saved, text, again, history = asyncio.run(lives())
    finally:
        api_server.kubectl("delete", "namespace", namespace, "--wait=false")
    assert loaded.reason is None, loaded.reason
    # What the runbook tells an operator's reader to look for (docs/runbooks/README.md).
    (said,) = [r.getMessage() for r in caplog.records if "stored history at other limits" in r.getMessage()]
    assert "re-held" in said and "rolled up from its steps" in said, said
    coarse = history.coarse
    assert coarse is not None and coarse.limits.step_s == 300
    # The week is whole in 5 min steps: every old step's requests, each hour's lengths.
    assert len(coarse) == 7 * 288 and coarse.start * 5 == FIRST_STEP
    assert sum(r for r in coarse.requests if r != MISSING) == sum(old.requests)
    assert max(coarse.requests) == 5 * 40 and min(coarse.requests) == 5 * 3
    assert history.prompt_histogram() == old.prompt_histogram()
    assert saved.written, saved.reason
    written = loads(text)
    assert written.limits == limits and written.coarse == coarse and written.requests == [5]
    assert again.reason is None and again.history == written
