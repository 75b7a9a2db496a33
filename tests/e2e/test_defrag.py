"""Defragmentation by migration on the local control plane, with kube-controller-manager (issue 19).

The seed case, for real: a Deployment's memory-unit tenants sit one per GPU on two l40s nodes (8 GPUs of
44 units), put there by bare 34-unit fillers that then go; a 35-unit pod fits on no GPU though 272 units
are free. The scheduler moves one tenant: the destination is reserved first, the tenant evicted through
the Eviction API, its ReplicaSet recreates it, the replacement lands on the reserved GPU and the big pod
on the freed one. Every pod then runs with at most 3 moves, the Events tell the story, the assignment
annotations show no GPU oversubscribed, and a minute more moves nothing (no allocation/eviction loop).
Without the action (`--defrag off`) the big pod would wait: the scheduler service's own test of that is
tests/scheduler/test_defrag.py.

Make-before-break (`gpupool.io/migrate: surge` on the Deployment): the same seed case moves the tenant by a
+1 replica that becomes Ready before the tenant goes, the Deployment's readyReplicas sampled every 200 ms
never below its spec; with an HPA on the Deployment the scheduler leaves its count alone."""

from __future__ import annotations

import json
import threading
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


def fragmented_pool(kube: ClusterClient, namespace: str, scheduler: str, annotations: dict[str, str] | None = None,
                    pod_annotations: dict[str, str] | None = None, *, grace_s: int = 0) -> tuple[str, list[str]]:
    """Two l40s nodes (8 GPUs of 44 units) with the 8 replicas of the `tenants` Deployment (10 units; its
    `annotations`, its pods' `pod_annotations` and grace period `grace_s`) one per GPU: bare 34-unit fillers
    take a GPU each first (two never share one), the tenants go where 10 units are left, then the fillers
    go. (kwok's `gpupool.io/stop-takes` pod annotation keeps an evicted tenant terminating that long.)"""
    apps = client.AppsV1Api(kube.api_client)
    pool = unique("defrag")
    nodes = add_pool_nodes(kube, pool, "l40s-pcie", 2)
    for i in range(8):
        kube.core.create_namespaced_pod(namespace, pod(f"filler-{i}", scheduler, pool, units=34))
    wait_until(lambda: sum(1 for p in list_pods(kube, namespace) if _bound(p)) == 8, 60, "8 fillers bound")
    template = pod("unused", scheduler, pool, units=10, labels={"app": "tenants"}, annotations=pod_annotations)
    template["spec"]["restartPolicy"] = "Always"
    template["spec"]["terminationGracePeriodSeconds"] = grace_s
    del template["metadata"]["name"]
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "tenants", "annotations": dict(annotations or {})},
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
            pool, nodes = fragmented_pool(kube, namespace, name, pod_annotations={"gpupool.io/stop-takes": "20s"},
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
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name, SURGE, SLOW_READY)
    try:
        wait_until(lambda: _deployment(kube, namespace)["status"].get("readyReplicas") == 8, 60, "8 tenants Ready")
        before = {p["metadata"]["uid"]: p for p in _tenants(kube, namespace)}
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
                if (not big or not _bound(big[0]) or len(tenants) != 8 or not all(_bound(p) for p in tenants)
                        or d["spec"]["replicas"] != 8 or (d["status"].get("readyReplicas") or 0) != 8):
                    return None
                return pods

            pods = wait_until(moved_and_settled, 120, "the big pod bound and the Deployment back to 8 Ready", 0.2)
            took = time.monotonic() - began
            moved = _moves(kube, namespace)
            assert len(moved) == 1 and "Moved by surge" in moved[0]["message"], moved
            (mover,) = [p for p in before.values() if p["metadata"]["name"] == moved[0]["name"]]
            now = {p["metadata"]["uid"]: p for p in _tenants(kube, namespace)}
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
        assert len(_moves(kube, namespace)) == 1
        assert {p["metadata"]["uid"] for p in _tenants(kube, namespace)} == set(now)
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
    pool, nodes = fragmented_pool(kube, namespace, scheduler.name, SURGE)
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
        before = {p["metadata"]["uid"] for p in _tenants(kube, namespace)}
        refused = scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="refused")
        with Sampler(kube, namespace) as sampler:
            kube.core.create_namespaced_pod(namespace, pod("big", scheduler.name, pool, units=35))
            said = wait_until(lambda: [e for e in events_for(kube, namespace, "big", "ConsolidationFailed")
                                       if "HorizontalPodAutoscaler" in e["message"]], 60, "big told about the HPA")
            time.sleep(20)  # more than an HPA sync period: had the count been changed, the HPA would have acted
        assert f"HorizontalPodAutoscaler {namespace}/tenants-hpa" in said[0]["message"]
        assert {(g, spec) for _, g, spec, _ in sampler.samples} == {(generation, 8)}
        assert min(s[3] for s in sampler.samples) == 8
        assert _moves(kube, namespace) == []
        assert {p["metadata"]["uid"] for p in _tenants(kube, namespace)} == before
        assert not next(p for p in list_pods(kube, namespace) if p["metadata"]["name"] == "big")["spec"].get(
            "nodeName")
        assert scheduler.metric("gpupool_scheduler_migrations_total", reason="blocked", result="refused") == refused + 1
    finally:
        apps.delete_namespaced_deployment("tenants", namespace)
        kube.delete_nodes(nodes)
