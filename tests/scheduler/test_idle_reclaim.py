"""Idle GPUs reclaimed through the real service (issue 20 §2) over the HTTP stand-in API server: the node's
gpupool.io/idle-pods annotation (written here as the device plugin's stand-in) names idle pods; the
reclaim-idle action evicts one for a pending pod within its guarantee (before anything busy), the sweep
evicts under action reclaim within the budget, report only reports, and a PodDisruptionBudget's 429 is
respected. The pure rules (never, start grace, gangs, budget): tests/unit/test_idle_reclaim.py."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, idle_pods_annotation
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.idle import IdleReclaimConfig
from gpupool_sched.framework.plugins.movers import JOBS
from gpupool_sched.scheduler.service import PDBS, PRIORITY_CLASSES, SchedulerConfig, SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer, serving
from tests.support.defrag_service import events, evictions, run_queue
from tests.support.objects import node_obj, ns_obj, pod_obj, quota_obj, team_spec

HOUR = 3600.0
STARTED = "2026-11-30T10:00:00Z"  # long before now: out of its start grace


async def with_idle(test: Callable[[SchedulerService, ApiServer], Awaitable[None]], **idle: Any) -> None:
    async with serving() as (server, api):
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces", JOBS):
            server.objects[path] = {}
        config = SchedulerConfig(defrag=DefragConfig(enabled=False), idle=IdleReclaimConfig(**idle))
        service = SchedulerService(config, api)
        service.recorder.start()
        try:
            await test(service, server)
        finally:
            await service.recorder.stop()
            await service.informers.stop()
            await service.binder.drain()
            await service.preemptor.drain()
            await service.idle.drain()


def running(service: SchedulerService, server: ApiServer, name: str, node: str, gpu: int, *, ns: str = "others",
            started: str = STARTED, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A running pod of one whole GPU, `gpu` of `node` (the plugin's ack says which)."""
    obj = pod_obj(name, gpus=1, node=node, phase="Running", annotations=annotations)
    obj["metadata"]["namespace"] = ns
    uuid = service.state.nodes[node].spec.gpus[gpu].uuid
    ack = AllocationAck(node=node, pod_uid=obj["metadata"]["uid"], complete=True,
                        containers={"main": {"nvidia.com/gpu": (uuid,)}})
    obj["metadata"]["annotations"].update(ack_annotations(ack))
    obj["status"]["startTime"] = started
    stored = server.put(PODS, obj)
    service.on_pod("ADDED", stored)
    return stored


def full_node(service: SchedulerService, server: ApiServer, **kw: Any) -> list[dict[str, Any]]:
    service.on_node("ADDED", server.put(NODES, node_obj("n1")))
    return [running(service, server, f"t{gpu}", "n1", gpu, **kw) for gpu in range(4)]


def list_idle(service: SchedulerService, server: ApiServer, idle: dict[str, float], node: str = "n1") -> None:
    """The device plugin's stand-in: the node annotation naming these pods idle since these times."""
    obj = copy.deepcopy(server.objects[NODES][f"/{node}"])
    obj["metadata"]["annotations"][IDLE_PODS_ANNOTATION] = idle_pods_annotation(idle)
    service.on_node("MODIFIED", server.put(NODES, obj))


def ago(seconds: float) -> float:
    return datetime.now(UTC).timestamp() - seconds


def uid(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["uid"])


def quotas(service: SchedulerService, *specs: tuple[str, dict[str, Any]]) -> None:
    for ns in ("team", "others"):
        service.quotas.on_namespace("ADDED", ns_obj(ns, team=ns))
    for name, spec in specs:
        service.quotas.on_quota("ADDED", quota_obj(name, spec, uid=f"q-{name}"))


def pending(service: SchedulerService, server: ApiServer, name: str, *, ns: str = "team", gpus: int = 1) -> dict:
    obj = pod_obj(name, gpus=gpus)
    obj["metadata"]["namespace"] = ns
    stored = server.put(PODS, obj)
    service.on_pod("ADDED", stored)
    return stored


def counted(service: SchedulerService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_an_idle_pod_is_reclaimed_for_a_pending_pod_within_its_guarantee_and_the_events_tell_it() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        quotas(service, ("team", team_spec("team", 2)),
               ("others", {**team_spec("others", 4), "idleReclaim": {"idleAfter": "1h"}}))
        tenants = full_node(service, server)
        idle = tenants[2]
        list_idle(service, server, {uid(idle): ago(2 * HOUR + 300), uid(tenants[3]): ago(600)})  # t3: not 1h yet
        waiting = pending(service, server, "train")
        await run_queue(service, rounds=3)

        assert evictions(server) == ["t2"]  # the idle one, none of the busy ones
        [victim] = events(server, "IdleReclaimed")
        assert victim["involvedObject"]["name"] == "t2"
        message = victim["message"]
        assert message.startswith("Idle for 2h05m (since ")
        assert "on node n1; its GPUs were needed by team/train (within its guarantee of GpuQuota team)" in message
        [preempting] = events(server, "Preempting")
        assert preempting["involvedObject"]["name"] == waiting["metadata"]["name"]
        assert preempting["message"] == ("Preempting 1 pod(s) idle on their GPUs past their idleAfter on node n1: "
                                         "others/t2")
        assert counted(service, "gpupool_scheduler_idle_reclaims_total", reason="needed", result="evicted") == 1
        assert counted(service, "gpupool_scheduler_idle_reclaimed_gpus_total", reason="needed") == 1
        assert service.idle.budget.left() == 9

    asyncio.run(with_idle(test))


def test_nothing_idle_is_taken_for_a_pod_that_would_borrow_at_equal_priority() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        quotas(service, ("team", team_spec("team", 0, borrow=4)),
               ("others", {**team_spec("others", 4), "idleReclaim": {"idleAfter": "1h"}}))
        tenants = full_node(service, server)
        list_idle(service, server, {uid(t): ago(2 * HOUR) for t in tenants})
        pending(service, server, "train")
        await run_queue(service, rounds=3)
        assert evictions(server) == []

    asyncio.run(with_idle(test))


def test_never_annotated_young_and_unlisted_pods_are_not_taken() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        quotas(service, ("team", team_spec("team", 2)), ("others", team_spec("others", 4)))
        service.on_node("ADDED", server.put(NODES, node_obj("n1")))
        never = running(service, server, "never", "n1", 0, annotations={"gpupool.io/idle-reclaim": "never"})
        young = running(service, server, "young", "n1", 1,
                        started=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        running(service, server, "busy", "n1", 2)
        running(service, server, "busy2", "n1", 3)
        list_idle(service, server, {uid(never): ago(5 * HOUR), uid(young): ago(5 * HOUR)})
        pending(service, server, "train")
        await run_queue(service, rounds=3)
        assert evictions(server) == []

    asyncio.run(with_idle(test, action="reclaimWhenNeeded", idle_after_s=60))


def test_a_pod_the_node_stops_listing_is_busy_again_at_once() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        quotas(service, ("team", team_spec("team", 2)), ("others", team_spec("others", 4)))
        tenants = full_node(service, server)
        list_idle(service, server, {uid(tenants[0]): ago(2 * HOUR)})
        list_idle(service, server, {})  # it worked again
        pending(service, server, "train")
        await run_queue(service, rounds=3)
        assert evictions(server) == []

    asyncio.run(with_idle(test, action="reclaimWhenNeeded", idle_after_s=60))


def test_the_sweep_reclaims_under_action_reclaim_within_the_budget() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = full_node(service, server)
        list_idle(service, server, {uid(tenants[0]): ago(3 * HOUR), uid(tenants[1]): ago(2 * HOUR),
                                    uid(tenants[2]): ago(30)})
        service.idle.tick(leading=False)
        await service.idle.drain()
        assert evictions(server) == []  # a standby evicts nothing
        assert counted(service, "gpupool_scheduler_idle_pods", action="reclaim") == 2
        assert counted(service, "gpupool_scheduler_idle_gpus", action="reclaim") == 2
        service.idle.tick(leading=True)
        await service.idle.drain()
        service.idle.tick(leading=True)
        await service.idle.drain()
        await service.recorder.flush()
        assert evictions(server) == ["t0"]  # the longest idle; the budget allows one
        [event] = events(server, "IdleReclaimed")
        assert event["message"].startswith("Idle for 3h (since ")
        assert event["message"].endswith("on node n1; the idle policy is reclaim: idle past idleAfter 1m")
        assert counted(service, "gpupool_scheduler_idle_reclaims_total", reason="policy", result="evicted") == 1
        assert counted(service, "gpupool_scheduler_idle_reclaims_total", reason="policy", result="blocked") == 1

    asyncio.run(with_idle(test, action="reclaim", idle_after_s=60, budget_per_hour=1))


def test_a_disruption_budget_refusal_is_respected_and_counted_blocked() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = full_node(service, server)
        server.refuse_evictions["t0"] = 429
        list_idle(service, server, {uid(tenants[0]): ago(2 * HOUR)})
        service.idle.tick(leading=True)
        await service.idle.drain()
        assert evictions(server) == ["t0"]  # asked, refused
        assert counted(service, "gpupool_scheduler_idle_reclaims_total", reason="policy", result="blocked") == 1
        assert service.state.pods[uid(tenants[0])].evicting_for is None  # a candidate again later
        assert service.idle.budget.left() == 10  # the refused reclaim does not count
        service.idle.tick(leading=True)
        await service.idle.drain()
        assert evictions(server) == ["t0"]  # not asked again at once

    asyncio.run(with_idle(test, action="reclaim", idle_after_s=60))


def test_report_only_reports_once_per_idle_spell() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = full_node(service, server)
        list_idle(service, server, {uid(tenants[1]): ago(2 * HOUR)})
        for _ in range(3):
            service.idle.tick(leading=True)
        pending(service, server, "train", ns="others")
        await run_queue(service, rounds=2)
        await service.idle.drain()
        await service.recorder.flush()
        assert evictions(server) == []
        [event] = events(server, "IdleGPU")
        assert event["involvedObject"]["name"] == "t1"
        assert event["message"].startswith("Idle on its GPUs for 2h (since ")
        assert event["message"].endswith("on node n1, past idleAfter 1h; the idle policy only reports: "
                                         "nothing is reclaimed")
        assert counted(service, "gpupool_scheduler_idle_pods", action="report") == 1
        list_idle(service, server, {uid(tenants[1]): ago(HOUR + 60)})  # busy meanwhile, idle again: a new spell
        service.idle.tick(leading=True)
        await service.recorder.flush()
        assert len(events(server, "IdleGPU")) == 2

    asyncio.run(with_idle(test, action="report"))


def test_no_policy_does_nothing_and_a_malformed_annotation_is_counted() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = full_node(service, server)
        list_idle(service, server, {uid(tenants[0]): ago(2 * HOUR)})
        service.idle.tick(leading=True)
        pending(service, server, "train", ns="others")
        await run_queue(service, rounds=2)
        assert evictions(server) == [] and events(server, "IdleGPU") == []
        assert counted(service, "gpupool_scheduler_idle_pods", action="none") == 1
        obj = copy.deepcopy(server.objects[NODES]["/n1"])
        obj["metadata"]["annotations"][IDLE_PODS_ANNOTATION] = "{not json"
        service.on_node("MODIFIED", server.put(NODES, obj))
        service.idle.tick(leading=True)
        assert counted(service, "gpupool_scheduler_idle_annotation_invalid_total") == 1
        assert counted(service, "gpupool_scheduler_idle_pods", action="none") == 0

    asyncio.run(with_idle(test))


def test_a_pod_of_higher_priority_takes_the_idle_pod_not_the_busy_one_preemption_would() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.on_node("ADDED", server.put(NODES, node_obj("n1")))
        # preemption takes the newest of the lowest priority: t3; the idle one is the oldest
        idle = running(service, server, "t0", "n1", 0, started="2026-11-29T10:00:00Z")
        for gpu in (1, 2, 3):
            running(service, server, f"t{gpu}", "n1", gpu, started=f"2026-11-30T1{gpu}:00:00Z")
        list_idle(service, server, {uid(idle): ago(2 * HOUR)})
        urgent = pod_obj("urgent", gpus=1)
        urgent["spec"]["priority"] = 100
        service.on_pod("ADDED", server.put(PODS, urgent))
        await run_queue(service, rounds=3)
        assert evictions(server) == ["t0"]
        [event] = events(server, "IdleReclaimed")
        assert event["message"].endswith("its GPUs were needed by ns/urgent (priority 100 > 0)")

    asyncio.run(with_idle(test, action="reclaimWhenNeeded", idle_after_s=60))


def test_a_gang_is_reclaimed_whole_or_not_at_all() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        quotas(service, ("team", team_spec("team", 4)), ("others", team_spec("others", 4)))
        service.on_node("ADDED", server.put(NODES, node_obj("n1")))
        gang = {"scheduling.x-k8s.io/pod-group": "g"}
        members = []
        for gpu in (0, 1):
            obj = running(service, server, f"m{gpu}", "n1", gpu)
            obj["metadata"]["labels"] = gang
            service.on_pod("MODIFIED", server.put(PODS, obj))
            members.append(obj)
        running(service, server, "busy2", "n1", 2)
        running(service, server, "busy3", "n1", 3)
        list_idle(service, server, {uid(m): ago(2 * HOUR) for m in members})
        pending(service, server, "one")  # one GPU: a plan would take one member alone
        await run_queue(service, rounds=3)
        assert evictions(server) == []
        service.on_pod("DELETED", server.objects[PODS]["team/one"])
        pending(service, server, "two", gpus=2)  # both members: the gang whole
        await run_queue(service, rounds=3)
        assert sorted(evictions(server)) == ["m0", "m1"]

    asyncio.run(with_idle(test, action="reclaimWhenNeeded", idle_after_s=60))


def test_an_idle_pod_a_disruption_budget_protects_is_left_and_preemption_goes_on() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.on_node("ADDED", server.put(NODES, node_obj("n1")))
        for gpu in range(4):
            running(service, server, f"t{gpu}", "n1", gpu, started=f"2026-11-30T1{gpu}:00:00Z")
        stored = server.objects[PODS]["others/t0"]
        stored["metadata"]["labels"] = {"app": "kept"}
        service.on_pod("MODIFIED", server.put(PODS, stored))
        service.on_pdb("ADDED", {"metadata": {"namespace": "others", "name": "kept"},
                                 "spec": {"selector": {"matchLabels": {"app": "kept"}}},
                                 "status": {"disruptionsAllowed": 0}})
        list_idle(service, server, {uid(stored): ago(2 * HOUR)})
        urgent = pod_obj("urgent", gpus=1)
        urgent["spec"]["priority"] = 100
        service.on_pod("ADDED", server.put(PODS, urgent))
        await run_queue(service, rounds=3)
        assert evictions(server) == ["t3"]  # preemption by priority: the newest busy pod
        assert events(server, "IdleReclaimed") == []
        assert counted(service, "gpupool_scheduler_idle_reclaims_total", reason="needed", result="blocked") >= 1

    asyncio.run(with_idle(test, action="reclaimWhenNeeded", idle_after_s=60))
