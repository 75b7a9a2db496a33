"""Team quotas with borrowing on the local control plane (issue 10, scenario 4c and the GpuQuota part of
4e): team A borrows team B's idle GPUs; B submits work; exactly enough of A's borrowed pods are preempted
for B's to run; A's pod beyond what it may borrow waits with an Event naming the quota. An invalid
GpuQuota gets Valid=False and changes nothing else."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from gpupool_devcluster.fake_pods import create_pods
from tests.support.fixtures import drop_namespace, make_namespace
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_bound,
    wait_until,
)

GROUP, VERSION, PLURAL = "gpupool.io", "v1alpha1", "gpuquotas"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quota-logs")


@pytest.fixture(scope="module")
def pool(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    install_crds(kube.api_client)
    name = unique("quota")
    nodes = add_pool_nodes(kube, name, "dgx-h100", 2)  # 16 GPUs
    yield name, nodes
    kube.delete_nodes(nodes)


@pytest.fixture
def teams(kube: ClusterClient) -> Iterator[tuple[str, str, str]]:
    tag = uuid.uuid4().hex[:6]
    a = make_namespace(kube, labels={"team": f"a-{tag}"})
    b = make_namespace(kube, labels={"team": f"b-{tag}"})
    yield tag, a, b
    drop_namespace(kube, a)
    drop_namespace(kube, b)


def quota(kube: ClusterClient, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(kube.api_client).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)


def quota_status(kube: ClusterClient, name: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(kube.api_client).get_cluster_custom_object(GROUP, VERSION, PLURAL, name)
    return dict(obj.get("status") or {})


def delete_quota(kube: ClusterClient, name: str) -> None:
    try:
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def lending(kube: ClusterClient, log_dir: Path, pool: tuple[str, list[str]],
            teams: tuple[str, str, str]) -> Iterator[tuple[str, str, SchedulerProcess]]:
    """Team A (8 GPUs guaranteed, 8 more it may borrow) fills the pool's 16 GPUs with one-GPU pods
    `a-0..15`, 8 of them borrowed from team B's idle guarantee of 8; a scheduler of its own. Yields the
    two quotas' names and the scheduler."""
    name, _ = pool
    tag, ns_a, _ = teams
    qa, qb = f"team-a-{tag}", f"team-b-{tag}"
    quota(kube, qa, {"namespaceSelector": {"matchLabels": {"team": f"a-{tag}"}}, "guaranteed": {"gpus": 8},
                     "borrowingLimit": {"gpus": 8}})
    quota(kube, qb, {"namespaceSelector": {"matchLabels": {"team": f"b-{tag}"}}, "guaranteed": {"gpus": 8}})
    proc: SchedulerProcess | None = None
    try:
        proc = start_scheduler(kube, unique("gpupool"), log_dir)
        create_pods(kube.core, ns_a, [pod(f"a-{i}", proc.name, name, gpus=1) for i in range(16)], concurrency=4)
        wait_bound(kube, ns_a, 16, timeout_s=90)
        yield qa, qb, proc
    finally:
        if proc is not None:
            proc.stop()
        delete_quota(kube, qa)
        delete_quota(kube, qb)


def assert_reclaimed(kube: ClusterClient, namespace: str, before: set[str], after: set[str], count: int) -> None:
    """Exactly `count` of the pods bound `before` are gone `after`, each told it went for a GpuQuota."""
    evicted = sorted(before - after)
    assert len(evicted) == count, f"A lost {evicted}: exactly {count} borrowed pods must go"
    for victim in evicted:
        preempted = events_for(kube, namespace, victim, "Preempted")
        assert preempted and "GpuQuota" in preempted[0]["message"], preempted


def test_borrowed_gpus_are_reclaimed_when_their_owner_needs_them(
    kube: ClusterClient, pool: tuple[str, list[str]], teams: tuple[str, str, str],
    lending: tuple[str, str, SchedulerProcess],
) -> None:
    name, _ = pool
    _, ns_a, ns_b = teams
    qa, qb, proc = lending
    sched = proc.name

    def a_status() -> dict[str, Any] | None:
        status = quota_status(kube, qa)
        return status if status.get("used", {}).get("gpus") == 16 else None

    status = wait_until(a_status, 20, "team A's GpuQuota status: 16 GPUs used")
    assert status["borrowed"]["gpus"] == 8
    # beyond its borrowing room: A's 17th pod waits, told which quota and by how much
    kube.core.create_namespaced_pod(ns_a, pod("a-extra", sched, name, gpus=1))

    def over_quota_event() -> list[dict[str, Any]]:
        return [e for e in events_for(kube, ns_a, "a-extra", "FailedScheduling") if qa in e["message"]]

    (event,) = wait_until(over_quota_event, 30, "a-extra: FailedScheduling naming team A's quota")[:1]
    assert "over" in event["message"], event["message"]
    before_a = {p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")}

    # B wants 4 of its guaranteed 8 back; the pool is full of A's pods
    create_pods(kube.core, ns_b, [pod(f"b-{i}", sched, name, gpus=1) for i in range(4)], concurrency=4)
    wait_bound(kube, ns_b, 4, timeout_s=90)
    after_a = {p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")}
    assert_reclaimed(kube, ns_a, before_a, after_a, 4)
    # A keeps its guarantee (8) plus what B still lends (4); its extra pod still may not borrow more
    assert len(after_a) == 12 and "a-extra" not in after_a

    def settled() -> tuple[dict[str, Any], dict[str, Any]] | None:
        sa, sb = quota_status(kube, qa), quota_status(kube, qb)
        ok = sa.get("used", {}).get("gpus") == 12 and sb.get("used", {}).get("gpus") == 4
        return (sa, sb) if ok else None

    sa, sb = wait_until(settled, 20, "quota status after the reclaim")
    assert sa["borrowed"]["gpus"] == 4 and sb["borrowed"]["gpus"] == 0
    assert proc.metric("gpupool_scheduler_quota_used", quota=qa, resource="gpus") == 12
    assert proc.metric("gpupool_scheduler_quota_borrowed", quota=qa, resource="gpus") == 4
    assert proc.metric("gpupool_scheduler_preemption_victims_total", reason="quota") == 4
    assert proc.metric("gpupool_scheduler_preemption_victims_total", reason="priority") == 0


def test_an_invalid_quota_is_marked_and_changes_nothing(
    kube: ClusterClient, log_dir: Path, pool: tuple[str, list[str]], teams: tuple[str, str, str],
) -> None:
    name, _ = pool
    tag, ns_a, _ = teams
    bad = f"bad-{tag}"
    # `In` without values: the API server's schema lets it through, the selector is meaningless
    quota(kube, bad, {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]},
                      "guaranteed": {"gpus": 0}})
    proc = start_scheduler(kube, unique("gpupool"), log_dir)
    try:
        def marked() -> dict[str, Any] | None:
            conditions = {c["type"]: c for c in quota_status(kube, bad).get("conditions", [])}
            valid = conditions.get("Valid")
            return valid if valid and valid["status"] == "False" else None

        valid = wait_until(marked, 20, "the invalid GpuQuota marked Valid=False")
        assert "operator In needs at least one value" in valid["message"], valid["message"]
        # it governs nothing: team A's pods are not limited by its 0 GPUs
        create_pods(kube.core, ns_a, [pod(f"p-{i}", proc.name, name, gpus=1) for i in range(3)], concurrency=3)
        wait_bound(kube, ns_a, 3, timeout_s=60)
    finally:
        proc.stop()
        delete_quota(kube, bad)


def test_a_gang_reclaims_its_teams_borrowed_gpus_for_its_whole_minimum(
    kube: ClusterClient, pool: tuple[str, list[str]], teams: tuple[str, str, str],
    lending: tuple[str, str, SchedulerProcess],
) -> None:
    """As the single-pod reclaim above, for a PodGroup: team B's 4 one-GPU workers (minMember 4) take back
    4 of the GPUs team A borrows, evicted together for the gang, which then binds whole."""
    name, _ = pool
    _, ns_a, ns_b = teams
    _, _, proc = lending
    sched = proc.name
    before_a = {p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")}
    group = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": "workers"},
             "spec": {"minMember": 4}}
    client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        "scheduling.x-k8s.io", "v1alpha1", ns_b, "podgroups", group)
    create_pods(kube.core, ns_b, [pod(f"w-{i}", sched, name, gpus=1,
                                      labels={"scheduling.x-k8s.io/pod-group": "workers"}) for i in range(4)],
                concurrency=4)
    wait_bound(kube, ns_b, 4, timeout_s=90)
    after_a = {p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")}
    assert_reclaimed(kube, ns_a, before_a, after_a, 4)
    assert proc.metric("gpupool_scheduler_preemption_victims_total", reason="quota") == 4
    assert proc.metric("gpupool_scheduler_preemption_victims_total", reason="priority") == 0


def test_a_gang_binds_only_the_members_its_quota_admits(
    kube: ClusterClient, log_dir: Path, pool: tuple[str, list[str]], teams: tuple[str, str, str],
) -> None:
    """Issue 16 A4: a quota of 2 guaranteed GPUs, borrowing 0, and a PodGroup of 4 one-GPU workers with
    minMember 2, on a pool with 16 free GPUs: exactly 2 bind, the other 2 stay pending with the quota's
    FailedScheduling Event (before: all 4 bound, 4 GPUs used). When a bound worker ends, a waiting one
    takes its place."""
    name, _ = pool
    tag, ns_a, _ = teams
    qa = f"gang-a-{tag}"
    quota(kube, qa, {"namespaceSelector": {"matchLabels": {"team": f"a-{tag}"}}, "guaranteed": {"gpus": 2}})
    proc = start_scheduler(kube, unique("gpupool"), log_dir)
    try:
        group = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": "workers"},
                 "spec": {"minMember": 2}}
        client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
            "scheduling.x-k8s.io", "v1alpha1", ns_a, "podgroups", group)
        create_pods(kube.core, ns_a, [pod(f"w-{i}", proc.name, name, gpus=1,
                                          labels={"scheduling.x-k8s.io/pod-group": "workers"}) for i in range(4)],
                    concurrency=4)
        wait_bound(kube, ns_a, 2, timeout_s=60)

        def waiting_told() -> list[str] | None:
            pending = [p["metadata"]["name"] for p in list_pods(kube, ns_a) if not p["spec"].get("nodeName")]
            told = [n for n in pending
                    if any(qa in e["message"] for e in events_for(kube, ns_a, n, "FailedScheduling"))]
            return pending if len(pending) == 2 and told == pending else None

        pending = wait_until(waiting_told, 30, "the 2 members beyond the quota pending, told its name")
        used = wait_until(lambda: quota_status(kube, qa).get("used", {}).get("gpus") == 2 or None, 20,
                          "the quota's status: 2 GPUs used")
        assert used
        time.sleep(3)  # housekeeping and retries had their chance: still 2
        bound = [p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")]
        assert len(bound) == 2, bound
        # one bound worker ends: one waiting worker takes its GPU, the last one still waits
        kube.core.delete_namespaced_pod(bound[0], ns_a, grace_period_seconds=0)
        wait_until(lambda: any(p["metadata"]["name"] in pending and p["spec"].get("nodeName")
                               for p in list_pods(kube, ns_a)) or None, 30, "a waiting worker bound")
        time.sleep(2)
        now = [p["metadata"]["name"] for p in list_pods(kube, ns_a) if p["spec"].get("nodeName")]
        assert len(now) == 2, now
    finally:
        proc.stop()
        delete_quota(kube, qa)
