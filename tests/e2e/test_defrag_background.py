"""Background consolidation on the local control plane, with kube-controller-manager (issue 19, section 3).

Two l40s nodes (4 GPUs of 44 memory units each) hold eight Deployment tenants of 10 units, one per GPU
(`fragmented_pool`): no GPU is whole free. A scheduler with `--defrag-background idle` and small timings
(`--defrag-background-quiet 5`, `--defrag-min-runtime 15` so that the spread state is measured before
anything moves, `--defrag-budget 10`, `--defrag-after 3600` so that no blocked-pod move mixes in) gathers
them with no pod waiting: each tenant's destination held before its eviction, its ReplicaSet's
replacement placed there, one migration at a time. Measured from the live pods with the project's own
functions (the ledger's `ClusterState` fed the nodes and pods, `free_gpus`, `cluster_fragmentation_milli`
for the workload profile the scheduler uses before it has seen 50 pods, `default_prior`): the count of
whole free GPUs goes up (0 -> 6 in the runs so far, one node whole free) and the FGD fragmentation goes
down (4.86 -> 1.06 GPUs), in at most the budget's moves (6 of 10), and a minute more moves nothing (the
planner stops when nothing gains; it plans again every 30 s). With `--defrag-background off` the same pool
keeps 0 whole free GPUs and the test fails.

A real pod that waits for GPUs (44 units: no GPU is whole free) stops it: no Consolidating Event and no
eviction for 30 s while it pends (`gpupool_scheduler_defrag_background_allowed` 0); deleted, the moves
start."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import read_json
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.placement.background import free_gpus
from gpupool_sched.placement.fragmentation import cluster_fragmentation_milli
from gpupool_sched.placement.workload import default_prior
from tests.support.defrag_cluster import bound, events_named, fragmented_pool, held_on, moves, tenants_of
from tests.support.scheduler_harness import (
    SchedulerProcess,
    assert_no_oversubscription,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_until,
)

BUDGET = 10
FLAGS = ("--defrag-background", "idle", "--defrag-background-quiet", "5", "--defrag-min-runtime", "15",
         "--defrag-budget", str(BUDGET), "--defrag-after", "3600")


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("defrag-background-logs"), *FLAGS)
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def measure(kube: ClusterClient, namespace: str, scheduler: str, nodes: list[str]) -> tuple[int, float]:
    """(whole free GPUs, FGD fragmentation in milli-GPU) of `nodes`, from the live nodes and pods, with the
    scheduler's own ledger and measures."""
    state = ClusterState(scheduler)
    for name in nodes:
        state.apply_node(read_json(kube.core.read_node(name, _preload_content=False)))
    for p in list_pods(kube, namespace):
        if p["spec"].get("nodeName") in nodes:
            state.apply_pod(p)
    return free_gpus(state.snapshot), cluster_fragmentation_milli(state.snapshot, default_prior())


def _consolidating(kube: ClusterClient, namespace: str) -> list[dict[str, Any]]:
    return [e for e in events_named(kube, namespace, "Consolidating") if "background consolidation" in e["message"]]


def test_background_consolidation_frees_whole_gpus_and_lowers_fragmentation_within_budget(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    apps = client.AppsV1Api(kube.api_client)
    nodes: list[str] = []
    try:
        _, nodes = fragmented_pool(kube, namespace, scheduler.name)
        before_uids = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
        free_before, frag_before = measure(kube, namespace, scheduler.name, nodes)
        assert not _consolidating(kube, namespace), "measured before anything moved (min-runtime 15 s)"
        assert free_before == 0
        began = time.monotonic()

        def settled() -> bool:
            planned = scheduler.metric("gpupool_scheduler_migrations_total", reason="background", result="planned")
            replaced = scheduler.metric("gpupool_scheduler_migrations_total", reason="background", result="replaced")
            tenants = tenants_of(kube, namespace)
            return (planned > 0 and planned == replaced and len(tenants) == 8 and all(bound(p) for p in tenants)
                    and measure(kube, namespace, scheduler.name, nodes)[0] >= 4)

        wait_until(settled, 120, "background moves done: every planned tenant replaced, a node whole free")
        # the planner goes on while it gains: wait until a plan finds nothing (no new move for 35 s)
        count = len(_consolidating(kube, namespace))
        while True:
            time.sleep(35)
            now = len(_consolidating(kube, namespace))
            if now == count:
                break
            count = now
            wait_until(settled, 60, "the later moves done")
        took = time.monotonic() - began
        free_after, frag_after = measure(kube, namespace, scheduler.name, nodes)
        moved = moves(kube, namespace)
        consolidating = _consolidating(kube, namespace)
        print(f"background consolidation: whole free GPUs {free_before} -> {free_after}, FGD fragmentation "
              f"{frag_before / 1000:.2f} -> {frag_after / 1000:.2f} GPUs, {len(moved)} move(s) in {took:.0f}s")
        assert free_after > free_before and free_after >= 4, "whole GPUs (a whole node) came free"
        assert frag_after < frag_before, "the FGD fragmentation went down"

        # every move within the budget, and each with its destination held before the eviction
        now_uids = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
        evicted = before_uids - now_uids
        assert 1 <= len(moved) <= BUDGET and len(evicted) == len(moved), (moved, evicted)
        metric = scheduler.metric
        evictions = metric("gpupool_scheduler_migrations_total", reason="background", result="evicted")
        assert evictions == len(moved), "every eviction was a planned background move"
        assert metric("gpupool_scheduler_migrations_total", reason="background", result="replaced") == len(moved), \
            "every replacement took the room held for it"
        assert metric("gpupool_scheduler_defrag_budget_remaining") == BUDGET - len(moved)
        assert metric("gpupool_scheduler_defrag_gpus_freed_total", reason="background") == free_after - free_before, \
            "the GPUs-freed metric counts the whole GPUs that came free"
        assert metric("gpupool_scheduler_migrations_total", reason="blocked", result="evicted") == 0
        assert len(consolidating) == len(moved) and all("held for its replacement" in e["message"]
                                                        for e in consolidating)
        assert {e["name"] for e in consolidating} == {m["name"] for m in moved}
        pods = list_pods(kube, namespace)
        replacements = [p for p in tenants_of(kube, namespace) if p["metadata"]["uid"] not in before_uids]
        assert sorted(p["spec"]["nodeName"] for p in replacements) == held_on(moved), \
            "every replacement landed on the node its mover's Event said its room was held on"
        assert_no_oversubscription(kube, pods)

        # the loop check: a minute more, nothing moves (the planner finds nothing to gain)
        time.sleep(60)
        assert len(moves(kube, namespace)) == len(moved), "no Moved Event in the minute after"
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == now_uids, "nobody evicted since"
        assert measure(kube, namespace, scheduler.name, nodes) == (free_after, frag_after)
    finally:
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)


def test_a_real_pod_waiting_for_gpus_stops_background_moves(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    apps = client.AppsV1Api(kube.api_client)
    nodes: list[str] = []
    try:
        pool, nodes = fragmented_pool(kube, namespace, scheduler.name)
        kube.core.create_namespaced_pod(namespace, pod("trainer", scheduler.name, pool, units=44))
        before_uids = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
        time.sleep(30)  # past min-runtime and the quiet time: background moves would have begun
        assert not _consolidating(kube, namespace) and not moves(kube, namespace), "nothing moved while it pends"
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == before_uids, "nobody evicted"
        assert not next(p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "trainer")["spec"].get(
            "nodeName"), "the trainer still waits"
        assert scheduler.metric("gpupool_scheduler_defrag_background_allowed") == 0
        # the pod goes: the quiet time passes and the moves begin (what stopped them was the pod)
        kube.core.delete_namespaced_pod("trainer", namespace, grace_period_seconds=0)
        wait_until(lambda: _consolidating(kube, namespace), 60, "background moves begin once nothing waits")
    finally:
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)
