"""Restart safety and high availability of `gpupool scheduler` on the local control plane, including a
failover in the middle of a preemption."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from tests.support.faultproxy import proxy_for
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    assert_no_oversubscription,
    events_for,
    list_pods,
    pod,
    priority_classes,
    start_scheduler,
    unique,
    wait_bound,
    wait_until,
)


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
    # The first replica talks through a proxy that freezes (holds every request and answer) when its 4th
    # Binding arrives: 3 Bindings reach the apiserver, their answers never reach the scheduler, and the
    # SIGKILL lands mid-burst however fast the scheduler binds (a watch-then-kill raced a 48-bind burst).
    with proxy_for(kube.cluster.layout.pki.folder, kube.server, label="first",
                   log_file=log_dir / "proxy-first.jsonl") as proxy:
        proxy.freeze_after_bindings(3)
        kubeconfig = proxy.write_kubeconfig(kube.kubeconfig, log_dir / "kubeconfig-first")
        first = start_scheduler(replace(kube, kubeconfig=kubeconfig), name, log_dir, ready=False)
        try:
            assert proxy.frozen.wait(60), "the first scheduler did not send 4 Bindings within 60 s"
            # the 3 let through are committed (their answers held from the scheduler)
            wait_until(lambda: len(proxy.binding_statuses) == 3, 15, "the apiserver's answers to 3 Bindings")
            assert proxy.binding_statuses == [201] * 3, proxy.binding_statuses
        finally:
            first.kill()  # SIGKILL: binds in flight are cut wherever they are
    bound_at_kill = wait_until(
        lambda: (n := sum(1 for p in list_pods(kube, namespace) if p["spec"].get("nodeName"))) >= 3 and n,
        15, "the 3 Bindings that reached the apiserver")
    assert bound_at_kill == 3, f"{bound_at_kill} pods bound; the proxy let 3 Bindings through"
    second = start_scheduler(kube, name, log_dir)
    try:
        pods = wait_bound(kube, namespace, len(manifests), timeout_s=120)
        assert_no_oversubscription(kube, pods)
        assert all(p["metadata"]["annotations"].get("gpupool.io/assignment") for p in pods)
    finally:
        second.stop()


@pytest.fixture
def replicas(kube: ClusterClient, log_dir: Path) -> Iterator[tuple[str, SchedulerProcess, SchedulerProcess]]:
    """Two schedulers of one name with leader election (lease 6 s, renew deadline 4 s, retry 1 s): the
    name, the one that leads, the one standing by."""
    name = unique("ha")
    lease = ["--leader-elect", "--lease-namespace", "default", "--lease-duration", "6",
             "--renew-deadline", "4", "--retry-period", "1"]
    a = start_scheduler(kube, name, log_dir, *lease, "--identity", "replica-a")
    b = start_scheduler(kube, name, log_dir, *lease, "--identity", "replica-b")
    try:
        leader = wait_until(lambda: next((s for s in (a, b) if s.metric("gpupool_scheduler_leader") == 1), None),
                            30, "a leader")
        yield name, leader, b if leader is a else a
    finally:
        a.stop()
        b.stop()


def test_standby_takes_over_within_the_lease(
    kube: ClusterClient, namespace: str, small_pool: str, replicas: tuple[str, SchedulerProcess, SchedulerProcess],
) -> None:
    name, leader, standby = replicas
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


@pytest.fixture
def two_nodes(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    pool = unique("ha-preempt")
    names = add_pool_nodes(kube, pool, "dgx-h100", 2)
    yield pool, names
    kube.delete_nodes(names)


@pytest.fixture
def low_and_critical(kube: ClusterClient) -> Iterator[tuple[str, ...]]:
    with priority_classes(kube, 100, 1000000, prefix="ha") as names:
        yield names


def test_failover_mid_preemption_keeps_the_nomination_and_evicts_nobody_else(
    kube: ClusterClient, namespace: str, two_nodes: tuple[str, list[str]], low_and_critical: tuple[str, ...],
    replicas: tuple[str, SchedulerProcess, SchedulerProcess],
) -> None:
    """The leader preempts one node's 8 pods for an 8-GPU pod and is killed while they shut down (kwok
    removes them 20 s after their deletion starts: `gpupool.io/stop-takes`). The new leader finds the pod
    pending, its victims terminating and no memory of the preemption: it must take the nomination from
    `status.nominatedNodeName`, neither preempt the other node's pods nor let a late pod of low priority
    into the freed GPUs, and bind the pod where its victims were."""
    pool, _nodes = two_nodes
    low, critical = low_and_critical
    name, leader, standby = replicas
    fill = []
    for i in range(16):
        manifest = pod(f"low-{i}", name, pool, gpus=1, priority_class=low,
                       annotations={"gpupool.io/stop-takes": "20s"})
        manifest["spec"]["terminationGracePeriodSeconds"] = 30  # a graceful delete: kwok then takes 20 s
        fill.append(manifest)
    create_pods(kube.core, namespace, fill, concurrency=8)
    placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in wait_bound(kube, namespace, 16)}
    create_pods(kube.core, namespace, [pod("critical", name, pool, gpus=8, priority_class=critical)])

    def nominated() -> str | None:
        obj = kube.core.read_namespaced_pod("critical", namespace)
        return obj.status.nominated_node_name if obj.status else None

    node = wait_until(nominated, 30, "the critical pod nominated")
    victims = {n for n, at in placed.items() if at == node}
    assert len(victims) == 8

    def terminating() -> set[str]:
        return {p["metadata"]["name"] for p in list_pods(kube, namespace) if p["metadata"].get("deletionTimestamp")}

    wait_until(lambda: terminating() == victims, 15, "the 8 victims terminating")
    leader.kill()
    wait_until(lambda: standby.metric("gpupool_scheduler_leader") == 1, 20, "the standby to lead", interval=0.2)
    # a late pod of low priority: it may not take what the victims free (it cannot preempt: same priority)
    create_pods(kube.core, namespace, [pod("late", name, pool, gpus=1, priority_class=low)])
    bound = wait_until(lambda: next((p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "critical"
                                     and p["spec"].get("nodeName")), None),
                       60, "the critical pod bound after its victims went")
    assert bound["spec"]["nodeName"] == node
    time.sleep(2.0)  # anything the new leader wrongly started would show by now
    pods = {p["metadata"]["name"]: p for p in list_pods(kube, namespace)}
    others = {n for n, at in placed.items() if at != node}
    assert others <= set(pods), f"pods of the other node gone: {sorted(others - set(pods))}"
    assert not any(pods[n]["metadata"].get("deletionTimestamp") for n in others), "evicted on the other node"
    assert not victims & set(pods), "a victim is still there"
    assert not pods["late"]["spec"].get("nodeName"), "the late pod took a GPU held for the critical pod"
    assert_no_oversubscription(kube, list(pods.values()))
    assert standby.metric("gpupool_scheduler_preemption_attempts_total", result="planned") == 0
