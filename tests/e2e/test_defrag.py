"""Defragmentation by migration on the local control plane, with kube-controller-manager (issue 19).

The seed case, for real: a Deployment's memory-unit tenants sit one per GPU on two l40s nodes (8 GPUs of
44 units), put there by bare 34-unit fillers that then go; a 35-unit pod fits on no GPU though 272 units
are free. The scheduler moves one tenant: the destination is reserved first, the tenant evicted through
the Eviction API, its ReplicaSet recreates it, the replacement lands on the reserved GPU and the big pod
on the freed one. Every pod then runs with at most 3 moves, the Events tell the story, the assignment
annotations show no GPU oversubscribed, and a minute more moves nothing (no allocation/eviction loop).
Without the action (`--defrag off`) the big pod would wait: the scheduler service's own test of that is
tests/scheduler/test_defrag.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from kubernetes import client

from gpupool_common.inventory import parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import read_json
from gpupool_sched.kube import migration_record
from tests.support.faultproxy import proxy_for
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    assert_no_oversubscription,
    device_use,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_until,
)


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("defrag-logs"),
                           "--defrag-after", "2", "--defrag-min-runtime", "0", "--defrag-budget", "10")
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def _bound(p: dict[str, Any]) -> bool:
    return bool(p["spec"].get("nodeName")) and not p["metadata"].get("deletionTimestamp")


def _tenants(kube: ClusterClient, namespace: str) -> list[dict[str, Any]]:
    return [p for p in list_pods(kube, namespace)
            if p["metadata"].get("labels", {}).get("app") == "tenants" and not p["metadata"].get("deletionTimestamp")]


def _moves(kube: ClusterClient, namespace: str) -> list[dict[str, Any]]:
    items = client.CoreV1Api(kube.api_client).list_namespaced_event(namespace, field_selector="reason=Moved").items
    return [{"name": e.involved_object.name, "message": e.message} for e in items]


def fragmented_pool(kube: ClusterClient, namespace: str, scheduler: str, *,
                    annotations: dict[str, str] | None = None, grace_s: int = 0) -> tuple[str, list[str]]:
    """Two l40s nodes (8 GPUs of 44 units) with the 8 replicas of the `tenants` Deployment (10 units) one
    per GPU: bare 34-unit fillers take a GPU each first (two never share one), the tenants go where 10
    units are left, then the fillers go. `annotations` and `grace_s`: the tenants' (kwok's
    `gpupool.io/stop-takes` keeps an evicted tenant terminating that long, with a grace period above it)."""
    apps = client.AppsV1Api(kube.api_client)
    pool = unique("defrag")
    nodes = add_pool_nodes(kube, pool, "l40s-pcie", 2)
    for i in range(8):
        kube.core.create_namespaced_pod(namespace, pod(f"filler-{i}", scheduler, pool, units=34))
    wait_until(lambda: sum(1 for p in list_pods(kube, namespace) if _bound(p)) == 8, 60, "8 fillers bound")
    template = pod("unused", scheduler, pool, units=10, labels={"app": "tenants"}, annotations=annotations)
    template["spec"]["restartPolicy"] = "Always"
    template["spec"]["terminationGracePeriodSeconds"] = grace_s
    del template["metadata"]["name"]
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "tenants"},
        "spec": {"replicas": 8, "selector": {"matchLabels": {"app": "tenants"}},
                 "template": {"metadata": template["metadata"], "spec": template["spec"]}}})
    wait_until(lambda: len([p for p in _tenants(kube, namespace) if _bound(p)]) == 8, 90, "8 tenants bound")
    for i in range(8):
        kube.core.delete_namespaced_pod(f"filler-{i}", namespace, grace_period_seconds=0)
    wait_until(lambda: not [p for p in list_pods(kube, namespace) if p["metadata"]["name"].startswith("filler")],
               60, "fillers gone")
    gpus, _ = device_use(kube, _tenants(kube, namespace))
    assert len(gpus) == 8 and all(sum(use.units.values()) == 10 for use in gpus.values())
    return pool, nodes


def test_the_seed_case_moves_one_tenant_and_every_pod_runs(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    apps = client.AppsV1Api(kube.api_client)
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name)
    try:
        before = {p["metadata"]["uid"] for p in _tenants(kube, namespace)}
        # one tenant per GPU: every GPU has 34 of 44 units free
        gpus, _ = device_use(kube, _tenants(kube, namespace))
        assert len(gpus) == 8 and all(sum(use.units.values()) == 10 for use in gpus.values())

        began = time.monotonic()
        kube.core.create_namespaced_pod(namespace, pod("big", scheduler.name, pool, units=35))

        def everything_runs() -> list[dict[str, Any]] | None:
            pods = list_pods(kube, namespace)
            tenants = [p for p in pods if p["metadata"].get("labels", {}).get("app") == "tenants"]
            big = [p for p in pods if p["metadata"]["name"] == "big"]
            if len(tenants) != 8 or not big or not all(_bound(p) for p in (*tenants, *big)):
                return None
            return pods

        pods = wait_until(everything_runs, 120, "the big pod and all 8 tenants bound")
        took = time.monotonic() - began
        moved = _moves(kube, namespace)
        assert 1 <= len(moved) <= 3, moved
        big = next(p for p in pods if p["metadata"]["name"] == "big")
        consolidating = events_for(kube, namespace, "big", "Consolidating")
        assert consolidating and all(m["name"] in consolidating[0]["message"] for m in moved)
        now = {p["metadata"]["uid"]: p for p in _tenants(kube, namespace)}
        replacements = [p for uid, p in now.items() if uid not in before]
        assert len(replacements) == len(moved)
        # every replacement landed on the node its mover's Event said its room was held on
        held = sorted(m["message"].rsplit("room held on node ", 1)[1].split(";")[0] for m in moved)
        assert sorted(p["spec"]["nodeName"] for p in replacements) == held
        assert big["spec"]["nodeName"] in nodes
        assert_no_oversubscription(kube, pods)
        assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="replaced") == len(moved)
        print(f"seed case: {len(moved)} move(s), everything bound {took:.1f}s after the big pod was created")

        # the loop check: on the consolidated state nothing moves again
        time.sleep(60)
        assert len(_moves(kube, namespace)) == len(moved)
        assert {p["metadata"]["uid"] for p in _tenants(kube, namespace)} == set(now)
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)


def test_a_spent_budget_makes_the_third_pod_wait_and_says_why(
    kube: ClusterClient, namespace: str, controller_manager: None, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """--defrag-budget 2: two 35-unit pods get a move each; the third waits, and its Event says why."""
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("defrag-budget-logs"),
                           "--defrag-after", "1", "--defrag-min-runtime", "0", "--defrag-budget", "2")
    apps = client.AppsV1Api(kube.api_client)
    pool, nodes = fragmented_pool(kube, namespace, proc.name)
    try:
        for i in (1, 2):
            kube.core.create_namespaced_pod(namespace, pod(f"big-{i}", proc.name, pool, units=35))
            wait_until(lambda i=i: next((_bound(p) for p in list_pods(kube, namespace)
                                         if p["metadata"]["name"] == f"big-{i}"), False), 90, f"big-{i} bound")
        assert len(_moves(kube, namespace)) == 2
        kube.core.create_namespaced_pod(namespace, pod("big-3", proc.name, pool, units=35))
        said = wait_until(lambda: [e for e in events_for(kube, namespace, "big-3", "FailedScheduling")
                                   if "defragmentation budget (2 moves per hour) is spent" in e["message"]],
                          60, "big-3 told the budget is spent")
        assert "no pod moves for it" in said[0]["message"]
        time.sleep(5)
        assert len(_moves(kube, namespace)) == 2
        assert not next(p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "big-3")["spec"].get(
            "nodeName")
        assert proc.metric("gpupool_scheduler_defrag_budget_remaining") == 0
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)
        proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def test_the_leader_killed_mid_migration_the_new_one_finishes_it_with_the_same_holds(
    kube: ClusterClient, namespace: str, controller_manager: None, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two replicas with leader election; the leader talks through a fault proxy that goes dark once the API
    server has answered its first eviction (the mover is evicted, the leader never learns it, nor sees the
    replacement), and is then killed. The evicted tenant takes 20 s to stop (kwok's `gpupool.io/stop-takes`),
    so the new leader takes over with the mover terminating and its replacement pending. It has only the
    blocked pod's `gpupool.io/migration` record and nomination to go by: the replacement must land on the
    very GPU the record holds for it, the big pod on the GPU the mover frees, nothing planned or evicted
    again, nothing double-booked, and a minute more moves nothing. (Without the record the new leader held
    nothing: its `replaced` count stayed 0 and the replacement went where its policy put it.)"""
    log_dir = tmp_path_factory.mktemp("defrag-failover")
    name = unique("defrag-ha")
    flags = ["--defrag-after", "2", "--defrag-min-runtime", "0", "--defrag-budget", "10", "--leader-elect",
             "--lease-namespace", "default", "--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1"]
    apps = client.AppsV1Api(kube.api_client)
    with proxy_for(kube.cluster.layout.pki.folder, kube.server, label="leader",
                   log_file=log_dir / "proxy-leader.jsonl") as proxy:
        kubeconfig = proxy.write_kubeconfig(kube.kubeconfig, log_dir / "kubeconfig-leader")
        first = start_scheduler(replace(kube, kubeconfig=kubeconfig), name, log_dir, *flags, "--identity", "replica-a")
        wait_until(lambda: first.metric("gpupool_scheduler_leader") == 1, 30, "replica-a leads")
        second = start_scheduler(kube, name, log_dir, *flags, "--identity", "replica-b")
        nodes: list[str] = []
        try:
            pool, nodes = fragmented_pool(kube, namespace, name, annotations={"gpupool.io/stop-takes": "20s"},
                                          grace_s=30)
            before = {p["metadata"]["uid"] for p in _tenants(kube, namespace)}
            proxy.freeze_after_evictions(1)
            kube.core.create_namespaced_pod(namespace, pod("big", name, pool, units=35))
            assert proxy.frozen.wait(90), "the leader evicted no tenant within 90 s"
            first.kill()
            wait_until(lambda: second.metric("gpupool_scheduler_leader") == 1, 20, "replica-b leads", interval=0.2)
            big = read_json(kube.core.read_namespaced_pod("big", namespace, _preload_content=False))
            record = migration_record.record_of(big)
            assert record is not None, "the blocked pod carries no migration record"
            (move,) = record.moves
            assert big["status"].get("nominatedNodeName") == record.node

            def settled() -> list[dict[str, Any]] | None:
                pods = list_pods(kube, namespace)
                tenants = [p for p in pods if p["metadata"].get("labels", {}).get("app") == "tenants"
                           and not p["metadata"].get("deletionTimestamp")]
                done = [p for p in pods if p["metadata"]["name"] == "big" and _bound(p)]
                return pods if done and len(tenants) == 8 and all(_bound(p) for p in tenants) else None

            pods = wait_until(settled, 120, "the big pod and 8 tenants bound after the failover")
            tenants = {p["metadata"]["uid"]: p for p in _tenants(kube, namespace)}
            (replacement,) = [p for uid, p in tenants.items() if uid not in before]
            assert move.mover not in tenants
            node = read_json(kube.core.read_node(move.destination.node, _preload_content=False))
            inventory = parse_inventory(node["metadata"]["annotations"]["gpupool.io/gpu-inventory"])
            held_gpu = inventory.gpus[move.destination.gpu_indices[0]].uuid
            gpus, _ = device_use(kube, [replacement])
            assert list(gpus) == [(move.destination.node, held_gpu)], (gpus, move.destination)
            bound_big = next(p for p in pods if p["metadata"]["name"] == "big")
            assert bound_big["spec"]["nodeName"] == record.node
            assert second.metric("gpupool_scheduler_migrations_total", reason="blocked", result="replaced") == 1
            assert second.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned") == 0
            assert second.metric("gpupool_scheduler_migrations_total", reason="blocked", result="evicted") == 0
            assert not _moves(kube, namespace)  # the old leader never heard its eviction answered: no Moved Event
            assert_no_oversubscription(kube, list_pods(kube, namespace))

            time.sleep(60)  # the loop check
            assert not _moves(kube, namespace)
            assert second.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned") == 0
            assert {p["metadata"]["uid"] for p in _tenants(kube, namespace)} == set(tenants)
        finally:
            apps.delete_namespaced_deployment("tenants", namespace)
            if nodes:
                kube.delete_nodes(nodes)
            second.stop()
            first.stop()
