"""Defragmentation by migration on the local control plane, with kube-controller-manager (issue 19).

The seed case, for real: a Deployment's memory-unit tenants sit one per GPU on two l40s nodes (8 GPUs of
44 units), put there by bare 34-unit fillers that then go; a 35-unit pod fits on no GPU though 272 units
are free. The scheduler moves one tenant: the destination is reserved first, the tenant evicted through
the Eviction API, its ReplicaSet recreates it, the replacement lands on the reserved GPU and the big pod
on the freed one. Every pod then runs with at most 3 moves, the Events tell the story, the assignment
annotations show no GPU oversubscribed, and a minute more moves nothing (no allocation/eviction loop).
Without the action (`--defrag off`) the big pod would wait: the scheduler service's own test of that is
tests/scheduler/test_defrag.py.

The same for a whole-GPU pod on one l40s node of four tenants: no GPU is empty, one tenant joins another
on the same node and the pod gets the GPU it leaves.

Nothing moves (each next to the case that does move on the same shape):
  * bare pods (nothing recreates them): a higher-priority pod that would fit after a move preempts one
    instead; with Deployment tenants of the same priority and shape it is a move, and nobody is preempted;
  * a tenant moved once (its replacement carries its lineage) within `--defrag-cooldown`: the second
    blocked pod waits; a scheduler without the cooldown moves it;
  * PodGroup members: the blocked pod waits and nobody is evicted; the whole-GPU case is the same pool
    and pod without the PodGroup.

Make-before-break (`gpupool.io/migrate: surge` on the Deployment): the same seed case moves the tenant by a
+1 replica that becomes Ready before the tenant goes, the Deployment's readyReplicas sampled every 200 ms
never below its spec; with an HPA on the Deployment the scheduler leaves its count alone.

Failover: the leader is killed after its first eviction, before it hears the answer; the new leader
finishes the plan from the blocked pod's `gpupool.io/migration` record."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.inventory import parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from gpupool_devcluster.raw import read_json
from gpupool_sched.framework.plugins.gangs import GROUP, PLURAL, POD_GROUP_LABEL, VERSION
from gpupool_sched.kube import migration_record
from tests.support.defrag_cluster import (
    bound,
    deployment,
    events_named,
    fragmented_pool,
    held_on,
    moves,
    named,
    tenants_of,
)
from tests.support.faultproxy import proxy_for
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    assert_no_oversubscription,
    device_use,
    events_for,
    list_pods,
    pod,
    priority_classes,
    start_scheduler,
    unique,
    wait_until,
)

FLAGS = ("--defrag-after", "2", "--defrag-min-runtime", "0", "--defrag-budget", "10")


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    install_crds(kube.api_client)  # PodGroups are served before the scheduler lists them
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("defrag-logs"), *FLAGS)
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def _consolidated(kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: str, nodes: list[str],
                  blocked: dict[str, Any], app: str, tenants: int) -> tuple[list[dict[str, Any]], set[str]]:
    """Create `blocked` on a fragmented pool of `tenants` Deployment tenants labelled app=`app`; every pod
    runs within 2 minutes with at most 3 moves, the Events say who moved for it and where each
    replacement's room is held, the replacements are there, no GPU is oversubscribed. Returns the Moved
    Events and the tenants' UIDs after."""
    name = blocked["metadata"]["name"]
    before = {p["metadata"]["uid"] for p in tenants_of(kube, namespace, app)}
    replaced = scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="replaced")
    began = time.monotonic()
    kube.core.create_namespaced_pod(namespace, blocked)

    def everything_runs() -> list[dict[str, Any]] | None:
        pods = list_pods(kube, namespace)
        mine = [p for p in pods if p["metadata"].get("labels", {}).get("app") == app]
        it = [p for p in pods if p["metadata"]["name"] == name]
        if len(mine) != tenants or not it or not all(bound(p) for p in (*mine, *it)):
            return None
        return pods

    pods = wait_until(everything_runs, 120, f"{name} and all {tenants} tenants bound within 2 minutes")
    took = time.monotonic() - began
    moved = [m for m in moves(kube, namespace) if f"to make room for {namespace}/{name} " in m["message"]]
    assert 1 <= len(moved) <= 3, f"at most 3 moves: {moved}"
    consolidating = events_for(kube, namespace, name, "Consolidating")
    assert all(any(m["name"] in c["message"] for c in consolidating) for m in moved), \
        f"a Consolidating Event on the pod names every mover: {consolidating} {moved}"
    now = {p["metadata"]["uid"]: p for p in tenants_of(kube, namespace, app)}
    replacements = [p for uid, p in now.items() if uid not in before]
    assert len(replacements) == len(moved), "one replacement per mover"
    assert sorted(p["spec"]["nodeName"] for p in replacements) == held_on(moved), \
        "every replacement landed on the node its mover's Event said its room was held on"
    it = next(p for p in pods if p["metadata"]["name"] == name)
    assert it["spec"]["nodeName"] in nodes
    assert_no_oversubscription(kube, pods)
    assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked",
                            result="replaced") - replaced == len(moved), "every replacement took its reservation"
    print(f"{name}: {len(moved)} move(s), everything bound {took:.1f}s after it was created")
    return moved, set(now)


def test_the_seed_case_and_a_whole_gpu_move_one_tenant_each_and_every_pod_runs(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    """The seed case (a 35-unit pod, two nodes of tenants), then on a pool of its own a pod asking a whole
    GPU: one l40s node, four tenants one per GPU, so no GPU is empty; one tenant joins another on the same
    node (shares gathered to free a whole GPU), its room held there before its eviction, and the pod gets
    the GPU it leaves. One loop check covers both: a minute after the second, nothing moved again."""
    apps = client.AppsV1Api(kube.api_client)
    made: list[str] = []
    try:
        pool, nodes = fragmented_pool(kube, namespace, scheduler.name)
        made += nodes
        whole_pool, whole_nodes = fragmented_pool(kube, namespace, scheduler.name, nodes=1, app="whole")
        made += whole_nodes

        moved, seed_uids = _consolidated(kube, namespace, scheduler, pool, nodes,
                                         pod("big", scheduler.name, pool, units=35), "tenants", 8)

        moved_w, whole_uids = _consolidated(kube, namespace, scheduler, whole_pool, whole_nodes,
                                            pod("trainer", scheduler.name, whole_pool, gpus=1), "whole", 4)
        assert len(moved_w) == 1, f"one move frees a whole GPU (the replacement keeps to its reserved GPU): {moved_w}"
        assert held_on(moved_w) == [whole_nodes[0]], "room held on the same node"
        gpus, _ = device_use(kube, [p for p in list_pods(kube, namespace) if p["spec"].get("nodeName")
                                    in whole_nodes])
        held_whole = [key for key, use in gpus.items() if use.whole == [f"{namespace}/trainer"]]
        assert len(held_whole) == 1 and not gpus[held_whole[0]].units, "the pod holds one GPU whole, unshared"
        assert sorted(sum(use.units.values()) for use in gpus.values() if use.units) == [10, 10, 20], \
            "the 4 tenants on the 3 other GPUs, two of them gathered on one"

        # the loop check: on the consolidated state nothing moves again
        time.sleep(60)
        assert len(moves(kube, namespace)) == len(moved) + len(moved_w), "no Moved Event in the minute after"
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == seed_uids, "nobody evicted since"
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace, "whole")} == whole_uids, \
            "nobody evicted since"
    finally:
        for app in ("tenants", "whole"):
            with contextlib.suppress(ApiException):
                apps.delete_namespaced_deployment(app, namespace)
        kube.delete_nodes(made)


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
            wait_until(lambda i=i: next((bound(p) for p in list_pods(kube, namespace)
                                         if p["metadata"]["name"] == f"big-{i}"), False), 90, f"big-{i} bound")
        assert len(moves(kube, namespace)) == 2
        kube.core.create_namespaced_pod(namespace, pod("big-3", proc.name, pool, units=35))
        said = wait_until(lambda: [e for e in events_for(kube, namespace, "big-3", "FailedScheduling")
                                   if "defragmentation budget (2 moves per hour) is spent" in e["message"]],
                          60, "big-3 told the budget is spent")
        assert "no pod moves for it" in said[0]["message"]
        time.sleep(5)
        assert len(moves(kube, namespace)) == 2
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
            pool, nodes = fragmented_pool(kube, namespace, name, pod_annotations={"gpupool.io/stop-takes": "20s"},
                                          grace_s=30)
            before = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
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
                done = [p for p in pods if p["metadata"]["name"] == "big" and bound(p)]
                return pods if done and len(tenants) == 8 and all(bound(p) for p in tenants) else None

            pods = wait_until(settled, 120, "the big pod and 8 tenants bound after the failover")
            tenants = {p["metadata"]["uid"]: p for p in tenants_of(kube, namespace)}
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
            assert not moves(kube, namespace)  # the old leader never heard its eviction answered: no Moved Event
            assert_no_oversubscription(kube, list_pods(kube, namespace))

            time.sleep(60)  # the loop check
            assert not moves(kube, namespace)
            assert second.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned") == 0
            assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == set(tenants)
        finally:
            apps.delete_namespaced_deployment("tenants", namespace)
            if nodes:
                kube.delete_nodes(nodes)
            second.stop()
            first.stop()


# ---- make-before-break: gpupool.io/migrate: surge ----------------------------------------------------
SURGE = {"gpupool.io/migrate": "surge"}
SLOW_READY = {"gpupool.io/ready-after": "3s"}  # kwok: Running at once, Ready 3 s later (a model loading)


class Sampler:
    """The `tenants` Deployment's metadata.generation, spec.replicas and status.readyReplicas every 200 ms,
    on a thread of its own, as (seconds since start, generation, spec, ready)."""

    def __init__(self, kube: ClusterClient, namespace: str, interval_s: float = 0.2) -> None:
        self.apps = client.AppsV1Api(kube.api_client)
        self.namespace = namespace
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deployment-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        began = time.monotonic()
        while not self._stop.is_set():
            at = time.monotonic()
            d = json.loads(self.apps.read_namespaced_deployment("tenants", self.namespace, _preload_content=False).data)
            self.samples.append((at - began, d["metadata"]["generation"], d["spec"]["replicas"],
                                 d["status"].get("readyReplicas") or 0))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - at)))


def _deployment(kube: ClusterClient, namespace: str) -> dict[str, Any]:
    apps = client.AppsV1Api(kube.api_client)
    return json.loads(apps.read_namespaced_deployment("tenants", namespace, _preload_content=False).data)


def test_a_surge_deployment_moves_without_a_dip_in_ready_replicas(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    """The seed case with the tenants' Deployment annotated gpupool.io/migrate: surge: the Deployment goes
    to 9, the new replica lands on the held destination and becomes Ready (kwok: 3 s after it starts, as
    gpupool.io/ready-after says; every tenant does), the Deployment goes back
    to 8 and its ReplicaSet removes the mover (the lowest deletion cost); the big pod lands on the freed
    GPU. Sampled every 200 ms, readyReplicas never drops below 8, also for a minute after (the loop check:
    nothing moves again). With eviction (no annotation) the same sampling sees 7 ready: the test fails."""
    apps = client.AppsV1Api(kube.api_client)
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name, annotations=SURGE, pod_annotations=SLOW_READY)
    try:
        wait_until(lambda: _deployment(kube, namespace)["status"].get("readyReplicas") == 8, 60, "8 tenants Ready")
        before = {p["metadata"]["uid"]: p for p in tenants_of(kube, namespace)}
        counts = {r: scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result=r)
                  for r in ("surged", "evicted", "replaced")}
        with Sampler(kube, namespace) as sampler:
            began = time.monotonic()
            kube.core.create_namespaced_pod(namespace, pod("big", scheduler.name, pool, units=35))

            def moved_and_settled() -> list[dict[str, Any]] | None:
                pods = list_pods(kube, namespace)
                big = [p for p in pods if p["metadata"]["name"] == "big"]
                tenants = [p for p in pods if p["metadata"].get("labels", {}).get("app") == "tenants"]
                d = _deployment(kube, namespace)
                if (not big or not bound(big[0]) or len(tenants) != 8 or not all(bound(p) for p in tenants)
                        or d["spec"]["replicas"] != 8 or (d["status"].get("readyReplicas") or 0) != 8):
                    return None
                return pods

            pods = wait_until(moved_and_settled, 120, "the big pod bound and the Deployment back to 8 Ready", 0.2)
            took = time.monotonic() - began
            moved = moves(kube, namespace)
            assert len(moved) == 1 and "Moved by surge" in moved[0]["message"], moved
            (mover,) = [p for p in before.values() if p["metadata"]["name"] == moved[0]["name"]]
            now = {p["metadata"]["uid"]: p for p in tenants_of(kube, namespace)}
            assert set(before) - set(now) == {mover["metadata"]["uid"]}  # the old replica is the one removed
            (new,) = [p for uid, p in now.items() if uid not in before]
            consolidating = events_for(kube, namespace, "big", "Consolidating")
            held = f"{mover['metadata']['name']} (to {new['spec']['nodeName']}, by surge)"
            assert consolidating and held in consolidating[0]["message"], consolidating
            big = next(p for p in pods if p["metadata"]["name"] == "big")
            assert big["spec"]["nodeName"] == mover["spec"]["nodeName"]
            assert_no_oversubscription(kube, pods)
            assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked",
                                    result="surged") == counts["surged"] + 1
            assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked",
                                    result="evicted") == counts["evicted"]
            assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked",
                                    result="replaced") == counts["replaced"] + 1
            on_deployment = [e.reason for e in client.CoreV1Api(kube.api_client).list_namespaced_event(
                namespace, field_selector="involvedObject.kind=Deployment,involvedObject.name=tenants").items
                if e.reason in ("Surging", "Surged")]
            assert sorted(on_deployment) == ["Surged", "Surging"], on_deployment
            surged_at = [t for t, _, spec, _ in sampler.samples if spec == 9]  # the window may fall between two
            # the loop check, still sampling: on the consolidated state nothing moves again
            time.sleep(60)
        assert len(moves(kube, namespace)) == 1
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == set(now)
        samples = sampler.samples
        span = samples[-1][0] - samples[0][0]
        assert len(samples) >= span / 0.2 * 0.5, f"{len(samples)} samples in {span:.0f}s"
        # spec.replicas written twice (9, then 8): each bumps the generation
        assert samples[-1][1] == samples[0][1] + 2 and {s[2] for s in samples} <= {8, 9}, samples[:3]
        low = [s for s in samples if s[3] < 8]
        assert not low, f"ready replicas below 8: {low[:10]}"
        print(f"surge: everything bound {took:.1f}s after the big pod was created; {len(samples)} samples over "
              f"{span:.0f}s ({len(surged_at)} of them at 9 replicas), ready replicas min "
              f"{min(s[3] for s in samples)}")
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)


def test_an_hpa_and_a_surge_deployment_do_not_fight(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    """An HPA scales the surge Deployment (maxReplicas 8: a surge to 9 would be undone by it at its next
    sync, the kube-controller-manager's HPA controller clamps to maxReplicas without any metrics). The
    scheduler does not scale it and does not evict it: spec.replicas and the generation stay as they were
    for more than an HPA sync period (15 s), no tenant moves, the big pod is told why and waits."""
    apps = client.AppsV1Api(kube.api_client)
    autoscaling = client.AutoscalingV2Api(kube.api_client)
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name, annotations=SURGE)
    try:
        autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, {
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "tenants-hpa"},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tenants"},
                     "minReplicas": 1, "maxReplicas": 8,
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]}})

        def reconciled() -> bool:  # the HPA controller has looked at it (no metrics: ScalingActive False)
            hpa = json.loads(autoscaling.read_namespaced_horizontal_pod_autoscaler(
                "tenants-hpa", namespace, _preload_content=False).data)
            return bool((hpa.get("status") or {}).get("conditions"))
        wait_until(reconciled, 60, "the HPA reconciled")
        generation = _deployment(kube, namespace)["metadata"]["generation"]
        before = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
        refused = scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="refused")
        with Sampler(kube, namespace) as sampler:
            kube.core.create_namespaced_pod(namespace, pod("big", scheduler.name, pool, units=35))
            said = wait_until(lambda: [e for e in events_for(kube, namespace, "big", "ConsolidationFailed")
                                       if "HorizontalPodAutoscaler" in e["message"]], 60, "big told about the HPA")
            time.sleep(20)  # more than an HPA sync period: had the count been changed, the HPA would have acted
        assert f"HorizontalPodAutoscaler {namespace}/tenants-hpa" in said[0]["message"]
        assert {(g, spec) for _, g, spec, _ in sampler.samples} == {(generation, 8)}
        assert min(s[3] for s in sampler.samples) == 8
        assert moves(kube, namespace) == []
        assert {p["metadata"]["uid"] for p in tenants_of(kube, namespace)} == before
        assert not next(p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "big")["spec"].get(
            "nodeName")
        assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="refused") == refused + 1
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)


def test_podgroup_members_never_move_and_the_blocked_pod_waits(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    """The pool and pod of the whole-GPU case, but the four tenants are the members of a PodGroup (a gang
    moves whole or not at all): nothing moves, nothing is evicted, the pod waits with a FailedScheduling
    Event. Without the PodGroup the same pod gets a GPU by one move (the whole-GPU half of the first test)."""
    apps = client.AppsV1Api(kube.api_client)
    client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "PodGroup", "metadata": {"name": "serving"},
        "spec": {"minMember": 4}})
    planned_before = scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned")
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name, nodes=1, labels={POD_GROUP_LABEL: "serving"})
    try:
        members = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
        assert len(members) == 4
        kube.core.create_namespaced_pod(namespace, pod("trainer", scheduler.name, pool, gpus=1))
        wait_until(lambda: events_for(kube, namespace, "trainer", "FailedScheduling"), 30,
                   "FailedScheduling on the blocked pod")
        time.sleep(8)  # past --defrag-after (2 s) and the retry it brings: a move would have started by now
        assert not events_named(kube, namespace, "Consolidating") and not moves(kube, namespace), \
            "no Consolidating or Moved Event"
        assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked",
                                result="planned") == planned_before, "no migration planned"
        tenants = tenants_of(kube, namespace)
        assert {p["metadata"]["uid"] for p in tenants} == members and all(bound(p) for p in tenants), \
            "every member still runs where it was: nobody evicted"
        trainer = named(kube, namespace, "trainer")
        assert trainer is not None and not trainer["spec"].get("nodeName"), "the blocked pod waits"
        assert not (trainer.get("status") or {}).get("nominatedNodeName"), "and is nominated nowhere"
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)


def test_bare_pods_are_preempted_not_moved_and_movable_ones_are_moved_not_preempted(
    kube: ClusterClient, namespace: str, controller_manager: None, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Four bare 10-unit pods of priority 100 (nothing recreates them), one per GPU of an l40s node: a
    priority-1000 pod asking a whole GPU would fit after one move, but bare pods never move, so it
    preempts one of them at once (no move could place it: `--defrag-after` holds nothing back). Four
    Deployment tenants of the same priority and shape on a second node: the same pod there waits
    `--defrag-after` (3 s) without preempting, then gets its GPU by a move, and nobody is preempted
    (nothing is killed without a destination; on 7e05171 it preempted a tenant on its first try)."""
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("defrag-preempt-logs"),
                           "--defrag-after", "3", "--defrag-min-runtime", "0", "--defrag-budget", "10")
    apps = client.AppsV1Api(kube.api_client)
    made: list[str] = []
    try:
        with priority_classes(kube, 100, 1000, prefix="defrag") as (low, high):
            pool, nodes = fragmented_pool(kube, namespace, proc.name, nodes=1, app="bare", bare=True,
                                          priority_class=low)
            made += nodes
            before = {p["metadata"]["name"]: p for p in tenants_of(kube, namespace, "bare")}
            kube.core.create_namespaced_pod(namespace, pod("urgent", proc.name, pool, gpus=1, priority_class=high))
            urgent = wait_until(lambda: (u := named(kube, namespace, "urgent")) and bound(u) and u, 60,
                                "the high-priority pod bound")
            left = {p["metadata"]["name"] for p in tenants_of(kube, namespace, "bare")}
            gone = sorted(set(before) - left)
            assert len(gone) == 1, f"exactly one bare pod preempted: {gone}"
            preempting = events_for(kube, namespace, "urgent", "Preempting")
            assert preempting and gone[0] in preempting[0]["message"], \
                f"a preemption of {gone}, announced on the pod: {preempting}"
            assert len(events_for(kube, namespace, gone[0], "Preempted")) == 1, "the victim told it was preempted"
            assert not events_named(kube, namespace, "Consolidating") and not moves(kube, namespace), \
                "bare pods never move: no Consolidating or Moved Event"
            victim_gpus, _ = device_use(kube, [before[gone[0]]])
            urgent_gpus, _ = device_use(kube, [urgent])
            assert set(urgent_gpus) == set(victim_gpus), "the pod runs on the GPU its victim held"
            assert proc.metric("gpupool_scheduler_preemption_victims_total") == 1
            assert proc.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned") == 0

            # the same priorities and shape with Deployment tenants: a move, no preemption
            pool2, nodes2 = fragmented_pool(kube, namespace, proc.name, nodes=1, priority_class=low)
            made += nodes2
            tenants_before = {p["metadata"]["uid"] for p in tenants_of(kube, namespace)}
            kube.core.create_namespaced_pod(namespace, pod("urgent-2", proc.name, pool2, gpus=1,
                                                           priority_class=high))

            def everything_runs() -> bool:
                tenants = tenants_of(kube, namespace)
                u = named(kube, namespace, "urgent-2")
                return len(tenants) == 4 and all(bound(p) for p in tenants) and u is not None and bound(u)

            wait_until(everything_runs, 120, "urgent-2 and all 4 tenants bound")
            moved = moves(kube, namespace)
            assert 1 <= len(moved) <= 3 and all(m["name"].startswith("tenants-") for m in moved), moved
            assert events_for(kube, namespace, "urgent-2", "Consolidating"), "a move, announced on the pod"
            waited = [e for e in events_for(kube, namespace, "urgent-2", "FailedScheduling")
                      if "not preempting meanwhile" in e["message"]]
            assert waited, "while it waited --defrag-after, the pod was told a move comes, not a preemption"
            assert not events_for(kube, namespace, "urgent-2", "Preempting"), "no preemption for urgent-2"
            assert len(events_named(kube, namespace, "Preempted")) == 1, "only the bare pod was ever preempted"
            assert proc.metric("gpupool_scheduler_preemption_victims_total") == 1
            replacements = [p for p in tenants_of(kube, namespace) if p["metadata"]["uid"] not in tenants_before]
            assert len(replacements) == len(moved) and all(p["spec"]["nodeName"] == nodes2[0] for p in replacements)
            assert_no_oversubscription(kube, list_pods(kube, namespace))
    finally:
        with contextlib.suppress(ApiException):  # not made if the first half failed
            apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(made)
        proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def test_a_tenant_moved_once_is_not_moved_again_within_the_cooldown(
    kube: ClusterClient, namespace: str, controller_manager: None, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One l40s node (GPUs of 44 units) shaped by bare pods, which never move, so that only the Deployment
    `solo` (one 10-unit replica) can: GPU a holds `solo`, GPU b a 30-unit pod, GPUs c and d 44 units each.
    `big-1` (35 units) fits nowhere: `solo` moves to GPU b (the only room for it) and big-1 takes GPU a.
    Then the test makes 10 units of room on GPU d (its 44-unit pod replaced by a 34-unit one); `big-2`
    (12 units) fits nowhere either, and only moving `solo`'s replacement off GPU b (to GPU d) would make
    room. It was moved within `--defrag-cooldown` (its replacement inherits the lineage), so big-2 waits
    with a FailedScheduling Event and nothing moves. A scheduler of the same name with no cooldown
    (`--defrag-cooldown 0`), on the very same state, moves it and big-2 binds: the wait was the cooldown."""
    logs = tmp_path_factory.mktemp("defrag-cooldown-logs")
    name = unique("gpupool")
    proc = start_scheduler(kube, name, logs, *FLAGS, "--defrag-cooldown", "3600")
    apps = client.AppsV1Api(kube.api_client)
    pool = unique("cooldown")
    nodes = add_pool_nodes(kube, pool, "l40s-pcie", 1)

    def bare(pod_name: str, units: int) -> None:
        kube.core.create_namespaced_pod(namespace, pod(pod_name, proc.name, pool, units=units))

    def wait_bound(*names: str) -> None:
        wait_until(lambda: all((p := named(kube, namespace, n)) is not None and bound(p) for n in names), 60,
                   f"{', '.join(names)} bound")

    def deleted(pod_name: str) -> None:
        kube.core.delete_namespaced_pod(pod_name, namespace, grace_period_seconds=0)
        wait_until(lambda: named(kube, namespace, pod_name) is None, 60, f"{pod_name} gone")

    def solo() -> list[dict[str, Any]]:
        return [p for p in tenants_of(kube, namespace, "solo") if bound(p)]

    try:
        bare("x-c", 44)
        bare("x-d", 44)
        wait_bound("x-c", "x-d")
        bare("filler-b", 35)  # one of the two empty GPUs
        wait_bound("filler-b")
        bare("filler-a", 34)  # the other: only 10 units left there
        wait_bound("filler-a")
        deployment(kube, namespace, "solo", 1, pod("unused", proc.name, pool, units=10))
        wait_until(lambda: len(solo()) == 1, 60, "solo bound next to filler-a")
        deleted("filler-b")
        bare("x-b", 30)  # GPU b: the only one with 30 units free
        wait_bound("x-b")
        deleted("filler-a")
        gpus, _ = device_use(kube, list_pods(kube, namespace))
        assert sorted(sum(use.units.values()) for use in gpus.values()) == [10, 30, 44, 44], gpus
        first = solo()[0]

        kube.core.create_namespaced_pod(namespace, pod("big-1", proc.name, pool, units=35))
        wait_bound("big-1")
        wait_until(lambda: len(solo()) == 1 and solo()[0]["metadata"]["uid"] != first["metadata"]["uid"], 60,
                   "solo's replacement bound")
        moved = moves(kube, namespace)
        assert [m["name"] for m in moved] == [first["metadata"]["name"]], f"one move, of solo: {moved}"
        wait_until(lambda: proc.metric("gpupool_scheduler_migrations_total", reason="blocked",
                                       result="replaced") == 1, 30, "the replacement placed on its reservation")
        replacement = solo()[0]
        gpus, _ = device_use(kube, list_pods(kube, namespace))
        shared = [use.units for use in gpus.values() if replacement["metadata"]["name"] in
                  {k.split("/")[1] for k in use.units}]
        assert shared and sorted(shared[0].values()) == [10, 30], f"solo's replacement joined x-b: {shared}"

        deleted("x-d")
        bare("y-d", 34)  # GPU d now has 10 units free: room for solo, not for big-2
        wait_bound("y-d")
        kube.core.create_namespaced_pod(namespace, pod("big-2", proc.name, pool, units=12))
        wait_until(lambda: events_for(kube, namespace, "big-2", "FailedScheduling"), 30,
                   "FailedScheduling on big-2")
        time.sleep(8)  # past --defrag-after (2 s) and the retry it brings: a move would have started by now
        assert len(moves(kube, namespace)) == 1, f"no second Moved Event: {moves(kube, namespace)}"
        assert not events_for(kube, namespace, "big-2", "Consolidating")
        now = solo()
        assert len(now) == 1 and now[0]["metadata"]["uid"] == replacement["metadata"]["uid"], \
            "solo's replacement still runs where it was"
        waiting = named(kube, namespace, "big-2")
        assert waiting is not None and not waiting["spec"].get("nodeName"), "big-2 waits"
        assert proc.metric("gpupool_scheduler_migrations_total", reason="blocked", result="planned") == 1
        proc.stop()
        assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"

        # not vacuous: the same state, no cooldown: solo's replacement moves to GPU d and big-2 runs
        proc = start_scheduler(kube, name, logs, *FLAGS, "--defrag-cooldown", "0")
        wait_bound("big-2")
        moved = moves(kube, namespace)
        assert sorted(m["name"] for m in moved) == sorted([first["metadata"]["name"],
                                                           replacement["metadata"]["name"]]), moved
        wait_until(lambda: len(solo()) == 1, 60, "solo's second replacement bound")
        assert_no_oversubscription(kube, list_pods(kube, namespace))
    finally:
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("solo", namespace)
        kube.delete_nodes(nodes)
        proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"
