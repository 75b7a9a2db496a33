"""Nothing deleted during a watch gap stays behind (issue 16 A1).

kopf answers 410 Gone by listing again, hands the listed objects over as events of type None and says
nothing of the objects missing from the list. The events below are exactly those kopf sends; the
service's re-list (over HTTP to tests/support/apiserver.py) must then find what was deleted. The
same gap against the real control plane: tests/e2e/test_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL, PODGROUPS
from gpupool_sched.framework.plugins.quotas import QUOTAS_PATH
from gpupool_sched.kube.informer import Drift, WatchedKind
from gpupool_sched.scheduler.service import PDBS, PRIORITY_CLASSES, SchedulerConfig, SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer, serving
from tests.support.objects import node_obj, ns_obj, pod_obj, quota_obj, team_spec


async def with_service(test: Callable[[SchedulerService, ApiServer], Awaitable[None]],
                       **config: Any) -> None:
    async with serving() as (server, api):
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces"):
            server.objects[path] = {}
        service = SchedulerService(SchedulerConfig(**config), api)
        try:
            await test(service, server)
        finally:
            await service.informers.stop()
            await service.binder.drain()


def repairs(service: SchedulerService, kind: str, change: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "gpupool_scheduler_cache_repairs_total", {"kind": kind, "change": change})
    return value or 0.0


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within the time")


def test_what_was_deleted_during_a_gap_leaves_the_state() -> None:
    """The review's reproduction: list {n1, n2, trainer (4 GPUs on n1)} → 410 → list {n1}."""

    async def test(service: SchedulerService, server: ApiServer) -> None:
        n1 = server.put(NODES, node_obj("n1"))
        n2 = server.put(NODES, node_obj("n2"))
        trainer = server.put(PODS, pod_obj("trainer", gpus=4, node="n1", phase="Running"))
        await service.resync()
        assert service.state.pods[trainer["metadata"]["uid"]].phase is Phase.CONFIRMED
        # the gap: n2 and the trainer are deleted; the watch hears nothing of it
        server.delete(NODES, n2)
        server.delete(PODS, trainer)
        service.informers.synced = True
        for kind in service.informers.kinds.values():  # kopf's first listing came and went long ago
            kind.kopf_listed = True
        service.synced.set()
        cycle = asyncio.get_running_loop().create_task(service._cycle_loop())
        try:
            # kopf's re-list after 410 Gone: what it finds, as events of type None, the new pod among them,
            # before anything about the nodes; nothing about what is gone
            newcomer = server.put(PODS, pod_obj("newcomer", gpus=4))
            service.informers.watch("pods", None, newcomer)
            assert service.informers.stale  # no decision until the re-list is applied
            service.informers.watch("nodes", None, server.objects[NODES]["/n1"])
            await until(lambda: service.informers.relists > 0)
            assert trainer["metadata"]["uid"] not in service.state.pods
            assert "n2" not in service.state.nodes and "n1" in service.state.nodes
            assert repairs(service, "pods", "deleted") == 1 and repairs(service, "nodes", "deleted") == 1
            # the newcomer gets n1's GPUs the trainer freed, and nothing is bound to the deleted n2
            await until(lambda: bool(server.bindings))
            await asyncio.sleep(0.2)
            assert server.bindings == [("ns/newcomer", "n1")]
            assert n1["metadata"]["name"] == "n1" and not service.informers.stale
        finally:
            cycle.cancel()
            await asyncio.gather(cycle, return_exceptions=True)

    asyncio.run(with_service(test))


def test_the_start_up_gap_is_closed_by_kopfs_first_listing() -> None:
    """The service lists everything, then kopf lists again: what went in between goes too."""

    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.put(NODES, node_obj("n1"))
        doomed = server.put(PODS, pod_obj("doomed", gpus=4, node="n1", phase="Running"))
        await service.resync()
        server.delete(PODS, doomed)
        for obj in list(server.objects[NODES].values()):  # kopf's first listing: what is left
            service.informers.watch("nodes", None, obj)
        assert service.informers["nodes"].event(None, server.objects[NODES]["/n1"]) is False  # a repeat: dropped
        await until(lambda: service.informers.relists > 0)
        assert doomed["metadata"]["uid"] not in service.state.pods

    async def started(service: SchedulerService, server: ApiServer) -> None:
        service.informers.synced = True  # as after start(): the first listing of kopf comes after it
        await test(service, server)
        assert not service.informers.stale  # kopf's first listing: re-listed, but nobody waited for it
        assert service.informers["nodes"].kopf_listed

    asyncio.run(with_service(started))


def test_the_periodic_check_repairs_drift_without_any_event() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.put(NODES, node_obj("n1"))
        ghost = server.put(PODS, pod_obj("ghost", gpus=2, node="n1", phase="Running"))
        missed = pod_obj("missed", gpus=1, node="n1", phase="Running")
        await service.resync()
        server.delete(PODS, ghost)
        server.put(PODS, missed)  # created during a gap: never seen either
        checks = asyncio.get_running_loop().create_task(service.informers.run_checks())
        try:
            await until(lambda: service.informers.relists > 0)
        finally:
            checks.cancel()
        assert ghost["metadata"]["uid"] not in service.state.pods
        assert missed["metadata"]["uid"] in service.state.pods
        assert repairs(service, "pods", "added") == 1 and repairs(service, "pods", "deleted") == 1

    asyncio.run(with_service(test, consistency_check_s=0.1))


def test_a_list_older_than_the_watch_changes_nothing_the_watch_showed() -> None:
    """client-go's rule: the list replaces only what it is newer than."""
    seen: list[tuple[str | None, str]] = []
    kind = WatchedKind("pods", PODS, lambda k, o: seen.append((k, o["metadata"]["name"])))
    old = {"metadata": {"uid": "u-old", "name": "old", "namespace": "ns", "resourceVersion": "10"}}
    young = {"metadata": {"uid": "u-young", "name": "young", "namespace": "ns", "resourceVersion": "30"}}
    kind.event("ADDED", old)
    kind.event("ADDED", young)  # the watch is ahead of the list below (rv 20)
    newer_old = {"metadata": {**old["metadata"], "resourceVersion": "25"}}
    kind.event("MODIFIED", newer_old)
    assert kind.replace([old], 20) == Drift()  # old listed at 10 < 25 seen; young is newer than the list
    assert kind.replace([], 20) == Drift()  # old seen at 25 > 20: the list may predate a change, keep it
    assert kind.replace([], 40) == Drift(deleted=2)
    assert seen[-2:] == [("DELETED", "old"), ("DELETED", "young")]
    assert kind.event("MODIFIED", {"metadata": {**young["metadata"], "resourceVersion": "50"}}) is False
    assert len(kind) == 0


def test_a_gangs_member_quota_and_budget_deleted_in_a_gap_are_gone_too() -> None:
    """A gang member deleted in the gap no longer counts toward minMember; a deleted GpuQuota no longer
    refuses its team's pods; a deleted PodDisruptionBudget no longer protects anyone."""

    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.put(NODES, node_obj("n1"))
        server.put("/api/v1/namespaces", ns_obj("ns", team="a"))
        quota = server.put(QUOTAS_PATH, quota_obj("a", team_spec("a", 0)))  # team a may use no GPU
        budget = server.put(PDBS, {"metadata": {"name": "b", "namespace": "ns", "uid": "pdb-1"},
                                   "spec": {"selector": {"matchLabels": {"app": "x"}}},
                                   "status": {"disruptionsAllowed": 0}})
        server.put(PODGROUPS, {"metadata": {"name": "g", "namespace": "ns", "uid": "g-1"},
                               "spec": {"minMember": 2}})
        worker = pod_obj("w0", gpus=1, node="n1", phase="Running")
        worker["metadata"]["labels"] = {POD_GROUP_LABEL: "g"}
        worker = server.put(PODS, worker)
        await service.resync()
        assert ("ns", "b") in service.budgets.budgets and service.gangs.placed("ns/g", service.state)
        assert not service.quotas.check(service.state.plan(pod_obj("p", gpus=1))).ok
        server.delete(PDBS, budget)
        server.delete(QUOTAS_PATH, quota)
        server.delete(PODS, worker)
        await service.informers.list_all()
        assert ("ns", "b") not in service.budgets.budgets
        assert service.gangs.placed("ns/g", service.state) == []
        assert service.quotas.check(service.state.plan(pod_obj("p", gpus=1))).ok

    asyncio.run(with_service(test))


def _meta(uid: str, version: int) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns", "resourceVersion": str(version)}}


def test_a_relist_holds_only_what_it_changes_and_applies_it_after_its_deletions() -> None:
    """A re-list is applied a page at a time: unchanged objects are dropped as their page goes by (the
    whole list is never held: 10,000 pods are ~100 MiB parsed), additions and changes wait until the
    deletions are known, and the deletions go first (a namesake may replace a deleted object)."""
    seen: list[tuple[str | None, str]] = []
    kind = WatchedKind("pods", PODS, lambda k, o: seen.append((k, o["metadata"]["name"])))
    for uid in ("a", "b", "c"):
        kind.event("ADDED", _meta(uid, 10))
    seen.clear()
    listing = kind.listing()
    assert not listing.eager
    listing.page([_meta("a", 10), _meta("b", 20)])
    assert [key for key, _ in listing.held] == ["b"] and seen == []
    listing.page([_meta("d", 15)])
    assert [key for key, _ in listing.held] == ["b", "d"] and seen == []
    assert listing.end(30) == Drift(added=1, updated=1, deleted=1)
    assert seen == [("DELETED", "c"), ("MODIFIED", "b"), ("ADDED", "d")]


def test_the_startup_list_hands_each_page_over_as_it_comes() -> None:
    """At start-up nothing is known, so nothing can be deleted: each page's objects go to the state
    before the next page is asked for, and a paged list (limit/continue, one snapshot) loses nothing."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.put(NODES, node_obj("n1"))
        for i in range(5):
            server.put(PODS, pod_obj(f"p{i}", gpus=1))
        handled_at: list[int] = []
        pods = service.informers["pods"]
        handler = pods.handler
        pods.handler = lambda kind, obj: (handled_at.append(server.page_requests), handler(kind, obj))[-1]
        service.informers.page = 2
        before = server.page_requests
        await service.informers.list_all(initial=True)
        assert len(handled_at) == 5 and len(pods) == 5
        assert server.page_requests - before >= 3 + 1  # pods in 3 pages, the node and the other kinds
        assert handled_at[0] < handled_at[-1], "the first page was applied before the last was fetched"
        assert not server.pages, "every continued list was read to its end"

    asyncio.run(with_service(test))


def test_handlers_never_see_managed_fields_and_the_caller_keeps_its_object() -> None:
    """kube-scheduler's informers strip metadata.managedFields (TransformStripManagedFields): a pending
    pod's object is kept until it is bound, and the field record is about half its parsed size."""
    got: list[dict[str, Any]] = []
    kind = WatchedKind("pods", PODS, lambda _k, o: got.append(o))
    obj = pod_obj("p", gpus=1)
    obj["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {}}}]
    kind.event("ADDED", obj)
    listing = kind.listing()
    listed = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "999999"}}
    listing.page([listed])
    listing.end(999999)
    assert len(got) == 2 and all("managedFields" not in o["metadata"] for o in got)
    assert got[0]["spec"] is obj["spec"] and got[0]["metadata"]["name"] == "p"
    assert "managedFields" in obj["metadata"], "the caller's (kopf's) object is not changed"
