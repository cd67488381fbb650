"""`bench podstart`'s pure pieces: containerd's event lines (as `ctr events` printed them on this
machine's node), the pod's instants joined into steps, the summary and its table."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from kubernetes.client import (
    V1Container,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)
from warmpool_bench.pod_start import (
    STEPS,
    PodSeen,
    PodWatch,
    parse_ctr_event,
    pod_instants,
    process_steps,
    sandbox_id,
    steps,
    task_started,
)
from warmpool_bench.podstart import breakdown
from warmpool_bench.podstart_report import render_podstart

pytestmark = pytest.mark.unit

SANDBOX = "d5a0beccf524098edee53e701971ed59d5511d34a61cb785838ed82ef65ab202"
WORKER = "3e2a93252f1ed466f2307a391c5711b74b292fb574175ca32e95de10f8d08a40"
UID = "40b3ee75-c05b-4dbd-b8f2-b0c9646adeeb"
LINES = [
    f'2026-12-04 23:09:42.356030427 +0000 UTC k8s.io /containers/create {{"id":"{SANDBOX}",'
    '"image":"warmpool.local/pause:1b0a067de70b","runtime":{"name":"io.containerd.runc.v2"}}',
    # another pod's sandbox, started at the same time: never taken for ours
    '2026-12-04 23:09:42.358000000 +0000 UTC k8s.io /containers/update {"id":"other","labels":'
    '{"io.cri-containerd.kind":"sandbox","io.kubernetes.pod.uid":"someone-else"}}',
    f'2026-12-04 23:09:42.359100549 +0000 UTC k8s.io /containers/update {{"id":"{SANDBOX}",'
    '"image":"warmpool.local/pause:1b0a067de70b","labels":{"io.cri-containerd.kind":"sandbox",'
    f'"io.kubernetes.pod.name":"evt","io.kubernetes.pod.namespace":"default","io.kubernetes.pod.uid":"{UID}"}},'
    f'"snapshot_key":"{SANDBOX}"}}',
    '2026-12-04 23:09:42.4 +0000 UTC k8s.io /tasks/start {"container_id":"other","pid":4990}',
    f'2026-12-04 23:09:42.460685986 +0000 UTC k8s.io /tasks/start {{"container_id":"{SANDBOX}","pid":4995}}',
    f'2026-12-04 23:09:42.539944393 +0000 UTC k8s.io /tasks/start {{"container_id":"{WORKER}","pid":5025}}',
    f'2026-12-04 23:09:50.18755566 +0000 UTC k8s.io /tasks/exit {{"container_id":"{SANDBOX}","pid":4995}}',
]


def _at(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def test_ctr_event_lines_parse_to_unix_times_and_payloads() -> None:
    event = parse_ctr_event(LINES[-2])
    assert event is not None
    assert event.at == pytest.approx(_at("2026-12-04 23:09:42.539944"), abs=1e-6)
    assert (event.namespace, event.topic, event.payload["pid"]) == ("k8s.io", "/tasks/start", 5025)
    # Go trims trailing zeros of the fraction: 8 digits, 1 digit
    trimmed = parse_ctr_event(LINES[-1])
    assert trimmed is not None and trimmed.at == pytest.approx(_at("2026-12-04 23:09:50.187555"), abs=1e-6)
    short = parse_ctr_event(LINES[3])
    assert short is not None and short.at == pytest.approx(_at("2026-12-04 23:09:42.400000"), abs=1e-6)
    whole = parse_ctr_event('2026-12-04 23:09:42 +0100 CET k8s.io /tasks/start {"container_id":"x"}')
    assert whole is not None and whole.at == pytest.approx(_at("2026-12-04 22:09:42"), abs=1e-6)


@pytest.mark.parametrize("line", ["", "ctr: failed to dial", "2026-12-04 23:09:42.1 +0000 UTC k8s.io /x {not json}",
                                  "2026-12-04 23:09:42.1 +0000 UTC k8s.io /x [1, 2]"])
def test_anything_but_an_event_line_is_skipped(line: str) -> None:
    assert parse_ctr_event(line) is None


def test_the_pods_sandbox_is_found_by_its_uid_label_and_tasks_by_container_id() -> None:
    events = [e for e in map(parse_ctr_event, LINES) if e is not None]
    assert len(events) == len(LINES)
    assert sandbox_id(events, UID) == SANDBOX
    assert sandbox_id(events, "no-such-pod") is None
    started = task_started(events, SANDBOX)
    assert started == pytest.approx(_at("2026-12-04 23:09:42.460686"), abs=1e-6)
    assert task_started(events, "absent") is None


def _instants(**missing: None) -> dict[str, float | None]:
    chain = dict(zip(["decision", *(end for _, end in STEPS)], [100.0 + i for i in range(len(STEPS) + 1)],
                     strict=True))
    chain["pod_ready"] = 120.0
    return {**chain, **missing}


def test_steps_are_gaps_between_consecutive_instants_and_add_up() -> None:
    got = steps(_instants())
    assert list(got) == [step for step, _ in STEPS]
    assert got["controllers"] == 1.0 and got["readiness"] == 120.0 - 107.0
    assert sum(v for v in got.values() if v is not None) == 20.0  # decision -> pod Ready


def test_a_missing_instant_leaves_its_step_and_the_next_unknown_never_zero() -> None:
    got = steps(_instants(sandbox_started=None))
    assert got["sandbox_cni"] is None and got["container_start"] is None
    assert got["scheduling"] == 1.0 and got["imports"] == 1.0


def test_a_plain_process_has_only_the_workers_steps_from_its_spawn() -> None:
    got = process_steps(10.0, {"process_start": 10.01, "imports_done": 12.0, "weights_loaded": 12.5, "ready": 14.0})
    assert got == {"imports": 2.0, "weights": 0.5, "warmup": 1.5}
    assert process_steps(10.0, {"imports_done": 12.0})["weights"] is None


def _pod(node: str | None = None, ready: bool = False, container_id: str | None = None) -> V1Pod:
    statuses = None if container_id is None else [
        V1ContainerStatus(name="worker", container_id=container_id, image="w", image_id="w", ready=ready,
                          restart_count=0)]
    conditions = [V1PodCondition(type="Ready", status="True" if ready else "False")]
    return V1Pod(metadata=V1ObjectMeta(name="p", uid=UID),
                 spec=V1PodSpec(node_name=node, containers=[V1Container(name="worker")]),
                 status=V1PodStatus(conditions=conditions, container_statuses=statuses, pod_ip="10.244.0.5"))


def test_the_watch_keeps_the_first_instant_of_each_transition() -> None:
    watch = PodWatch(core=None, namespace="ns", selector="x=y", timeout_s=1)
    watch.observe(_pod(), 1.0)
    watch.observe(_pod(node="n"), 2.0)
    watch.observe(_pod(node="n", container_id=f"containerd://{WORKER}"), 3.0)
    watch.observe(_pod(node="n", ready=True, container_id=f"containerd://{WORKER}"), 4.0)
    watch.observe(_pod(node="n", ready=True, container_id=f"containerd://{WORKER}"), 5.0)
    seen = watch.first()
    assert seen == PodSeen(uid=UID, name="p", created=1.0, bound=2.0, ready=4.0, container_id=WORKER, ip="10.244.0.5")
    events = [e for e in map(parse_ctr_event, LINES) if e is not None]
    instants = pod_instants(0.5, seen, events, {"imports_done": 44.0, "weights_loaded": 45.0, "ready": 46.0})
    assert instants["sandbox_started"] == task_started(events, SANDBOX)
    assert instants["container_started"] == task_started(events, WORKER)
    assert pod_instants(0.5, seen, None, {})["sandbox_started"] is None  # no node events: unknown


def _model() -> dict[str, Any]:
    def pod_run(round_index: int, shift: float) -> dict[str, Any]:
        instants = _instants()
        instants["pod_ready"] = 120.0 + shift
        return {"round": round_index, "instants": instants, "steps": steps(instants),
                "decision_to_first_token_s": 18.0 + shift}

    process = {"round": 0, "steps": {"imports": 2.0, "weights": 0.5, "warmup": 1.5}, "decision_to_first_token_s": 4.2}
    return {"label": "tiny", "weight_bytes": 10**6, "variants": {
        "new_pod": {"runs": [pod_run(0, 0.0), pod_run(1, 2.0), {"round": 2, "error": "no pod"}]},
        "fresh_process": {"runs": [process]}}}


def test_the_breakdown_takes_medians_over_good_runs_and_splits_the_owners() -> None:
    figures = breakdown(_model())
    assert figures["runs"] == {"new_pod": 2, "fresh_process": 1}
    assert figures["new_pod_ready_s"] == 21.0  # medians of 20 and 22
    assert figures["new_pod_steps_s"]["readiness"] == 14.0
    assert figures["runtime_share"] == pytest.approx((2 / 20 + 2 / 22) / 2)  # per run, then the median
    assert figures["worker_in_pod_minus_process_s"] == {"imports": -1.0, "weights": 0.5, "warmup": -0.5}
    assert figures["new_pod_over_process"] == pytest.approx(21 / 4)
    model = _model() | {"breakdown": figures}
    result = {"started_at": "t", "machine": {"cpus": 2, "loadavg": [0.1]}, "wall_s": 1.0,
              "settings": {"rounds": 3, "dtype": "bfloat16", "torch_threads": 1, "buckets": [16],
                           "prompts_per_bucket": 1}, "models": {"tiny": model}}
    text = render_podstart(result)
    assert text.startswith("# warmpool bench podstart")
    assert "| worker ready → pod Ready (kubelet probes) | 14.000 | 67 % | (no such step) |" in text
    assert "| 2 | error: no pod |" in text
