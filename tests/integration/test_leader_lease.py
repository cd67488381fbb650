"""Leader election's Lease on the real API server (app/leader.py over warmpool.lease), attempt by attempt: a standby
takes a Lease only once it has seen the record stand still for the lease's duration by its own
clock (whatever the holder's clock wrote), and a released Lease at its first attempt."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config
from warmpool_devcluster.testing import ClusterHandle
from warmpool_operator.app import leader
from warmpool_operator.io.kube import Kube

from warmpool.lease import Lease, Observed

pytestmark = pytest.mark.integration

NAME = "warmpool-operator"


def config(namespace: str, identity: str) -> leader.LeaderConfig:
    return leader.LeaderConfig(namespace=namespace, name=NAME, identity=identity,
                               lease_duration=2.0, renew_deadline=1.5, retry_period=0.5)


def lease_spec(cluster: ClusterHandle, namespace: str) -> dict[str, Any]:
    lease = json.loads(cluster.kubectl("get", "lease", NAME, "-n", namespace, "-o", "json").stdout)
    spec: dict[str, Any] = lease["spec"]
    return spec


async def connect(cluster: ClusterHandle) -> Kube:
    return Kube(await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig)))


def hold(kube: Kube, cfg: leader.LeaderConfig, observed: Observed | None = None) -> Lease:
    lease = leader.leader_lease(kube, cfg)
    lease.observed = observed or lease.observed
    return lease


async def take_over(lease: Lease) -> float:
    """Attempts every 0.1 s until ``lease`` is held (at most 20 s); the seconds it took."""
    began = time.monotonic()
    while not await lease.try_acquire():
        assert time.monotonic() - began < 20, f"{lease.identity} never took the Lease"
        await asyncio.sleep(0.1)
    return time.monotonic() - began


async def test_a_standby_waits_out_the_duration_by_its_own_clock_and_a_released_lease_goes_at_once(
        cluster: ClusterHandle, namespace: str) -> None:
    a, b = config(namespace, "a-1-aaaaaa"), config(namespace, "b-1-bbbbbb")
    kube = await connect(cluster)
    try:
        assert await hold(kube, a).try_acquire()
        b_lease = hold(kube, b)
        assert not await b_lease.try_acquire()
        # A stops renewing: B takes over, never before the duration has passed since it first saw the record.
        assert await take_over(b_lease) >= a.lease_duration
        spec = lease_spec(cluster, namespace)
        assert spec["holderIdentity"] == b.identity and spec["leaseTransitions"] == 1
        assert await b_lease.try_acquire()  # its own: renewed, no wait

        # B releases it (SIGTERM): A takes it at its first attempt; B's release is not A's to undo.
        assert await hold(kube, b).release()
        assert lease_spec(cluster, namespace)["holderIdentity"] == ""
        assert await hold(kube, a).try_acquire()
        assert not await hold(kube, b).release()
        spec = lease_spec(cluster, namespace)
        assert spec["holderIdentity"] == a.identity and spec["leaseTransitions"] == 2
    finally:
        await kube.close()


async def test_a_holder_whose_clock_runs_ahead_cannot_keep_the_lease_for_ever(
        cluster: ClusterHandle, namespace: str) -> None:
    """A renewTime in the future by the standby's clock (the dead holder's clock ran ahead): judged by
    when the standby saw it, the Lease still expires after its duration."""
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": NAME, "namespace": namespace},
        "spec": {"holderIdentity": "skewed-1-cccccc", "leaseDurationSeconds": 2, "leaseTransitions": 0,
                 "acquireTime": "2099-01-01T00:00:00.000000Z", "renewTime": "2099-01-01T00:00:00.000000Z"}}))
    b = config(namespace, "b-1-bbbbbb")
    kube = await connect(cluster)
    try:
        assert await take_over(hold(kube, b, Observed())) >= 2.0
        assert lease_spec(cluster, namespace)["holderIdentity"] == b.identity
    finally:
        await kube.close()
