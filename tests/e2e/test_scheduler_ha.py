"""Restart safety and high availability of `gpupool scheduler` on the local control plane."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import watch
from scheduler_harness import (
    add_pool_nodes,
    assert_no_oversubscription,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_bound,
    wait_until,
)

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def small_pool(kube: ClusterClient) -> Iterator[str]:
    pool = unique("ha")
    names = add_pool_nodes(kube, pool, "dgx-h100", 4) + add_pool_nodes(kube, pool, "a100-mig", 2)
    yield pool
    kube.delete_nodes(names)


def _burst(scheduler: str, pool: str, count: int) -> list[dict[str, object]]:
    """Whole GPUs, memory shares and MIG slices that all fit the pool (4x8 H100 + 2 a100-mig)."""
    out = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            out.append(pod(f"w-{i}", scheduler, pool, gpus=1))
        elif kind == 1:
            out.append(pod(f"u-{i}", scheduler, pool, units=10))
        else:
            out.append(pod(f"m-{i}", scheduler, pool, mig={"1g.10gb": 1}))
    return out


def test_sigkill_mid_burst_then_restart_allocates_nothing_twice(
    kube: ClusterClient, namespace: str, small_pool: str, log_dir: Path
) -> None:
    name = unique("restart")
    manifests = _burst(name, small_pool, 48)  # 16 whole GPUs, 160 units, 16 of the 18 1g.10gb slices
    create_pods(kube.core, namespace, manifests, concurrency=16)
    first = start_scheduler(kube, name, log_dir, ready=False)
    # a watch, not a LIST poll: a burst of 48 binds can finish between two polls
    bound: set[str] = set()
    stream = watch.Watch()
    for event in stream.stream(kube.core.list_namespaced_pod, namespace, timeout_seconds=60):
        obj = event["object"]
        if obj.spec.node_name:
            bound.add(obj.metadata.name)
        if len(bound) >= 3:
            first.kill()  # SIGKILL: binds in flight are cut wherever they are
            stream.stop()
            break
    else:
        first.kill()
        raise AssertionError("the first binds did not come within 60 s")
    bound_at_kill = sum(1 for p in list_pods(kube, namespace) if p["spec"].get("nodeName"))
    second = start_scheduler(kube, name, log_dir)
    try:
        pods = wait_bound(kube, namespace, len(manifests), timeout_s=120)
        assert_no_oversubscription(kube, pods)
        assert all(p["metadata"]["annotations"].get("gpupool.io/assignment") for p in pods)
    finally:
        second.stop()
    assert bound_at_kill < len(manifests), "the kill came after the burst; nothing was tested"


def test_standby_takes_over_within_the_lease(
    kube: ClusterClient, namespace: str, small_pool: str, log_dir: Path
) -> None:
    name = unique("ha")
    lease = ["--leader-elect", "--lease-namespace", "default", "--lease-duration", "6",
             "--renew-deadline", "4", "--retry-period", "1"]
    a = start_scheduler(kube, name, log_dir, *lease, "--identity", "replica-a")
    b = start_scheduler(kube, name, log_dir, *lease, "--identity", "replica-b")
    try:
        leader = wait_until(lambda: next((s for s in (a, b) if s.metric("gpupool_scheduler_leader") == 1), None),
                            30, "a leader")
        standby = b if leader is a else a
        assert standby.metric("gpupool_scheduler_leader") == 0
        assert standby.get("/readyz")[0] == 200  # standing by is ready
        create_pods(kube.core, namespace, [pod(f"before-{i}", name, small_pool, gpus=1) for i in range(6)])
        wait_bound(kube, namespace, 6)
        # Scheduled Events are posted after the Binding, off the scheduling path: wait for them
        for i in range(6):
            events = wait_until(lambda i=i: events_for(kube, namespace, f"before-{i}", "Scheduled"), 15,
                                f"before-{i}'s Scheduled event")
            assert {e.get("reportingInstance") for e in events} == {leader.args[-1]}, events
        leader.kill()
        killed = time.monotonic()
        create_pods(kube.core, namespace, [pod(f"after-{i}", name, small_pool, gpus=1) for i in range(6)])
        wait_until(lambda: standby.metric("gpupool_scheduler_leader") == 1, 20, "the standby to lead", interval=0.1)
        took_over = time.monotonic() - killed
        wait_bound(kube, namespace, 12, timeout_s=30)
        assert took_over <= 6 + 1 + 1, f"took over after {took_over:.1f}s (lease 6s, retry 1s)"
        for i in range(6):
            events = wait_until(lambda i=i: events_for(kube, namespace, f"after-{i}", "Scheduled"), 15,
                                f"after-{i}'s Scheduled event")
            assert {e.get("reportingInstance") for e in events} == {standby.args[-1]}, events
        pods = list_pods(kube, namespace)
        assert_no_oversubscription(kube, pods)
    finally:
        a.stop()
        b.stop()
