"""A committed gang whose member's Binding fails is made whole again or released whole (issue 16 A6):
the member is retried; if the gang is still short after its timeout, the bound members are evicted, and
the PodGroup's Events say which. Before, the bound member ran alone for ever and the waiting one was told
"0 of the 1 members it needs"."""

from __future__ import annotations

import asyncio
from typing import Any

from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from tests.support.apiserver import PODS, ApiServer, serving, settle
from tests.support.objects import node_obj, pod_obj


def member(name: str, gpus: int) -> dict[str, Any]:
    obj = pod_obj(name, gpus=gpus)
    obj["metadata"]["labels"] = {POD_GROUP_LABEL: "g"}
    return obj


def events(server: ApiServer, reason: str) -> list[dict[str, Any]]:
    return [body for method, path, body in server.written if path.endswith("/events") and body.get("reason") == reason]


async def until(predicate: Any, timeout_s: float = 6.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within the time")


async def with_service(test: Any) -> None:
    async with serving() as (server, api):
        service = SchedulerService(SchedulerConfig(), api)
        try:
            await test(service, server)
        finally:
            await service.binder.drain()


def test_a_gang_short_of_a_member_after_its_timeout_is_released_whole() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.recorder.start()
        service.on_node("ADDED", node_obj("n1"))  # 4 GPUs
        service.on_pod_group("ADDED", {"metadata": {"name": "g", "namespace": "ns", "uid": "g-1"},
                                       "spec": {"minMember": 2, "scheduleTimeoutSeconds": 1}})
        server.refuse["b"] = 403  # b's Binding is refused: a definite failure inside a committed gang
        a = server.put(PODS, member("a", 2))
        b = server.put(PODS, member("b", 2))
        service.on_pod("ADDED", a)
        service.on_pod("ADDED", b)
        await settle(service, rounds=3)
        assert server.bindings == [("ns/a", "n1")]
        await until(lambda: bool(events(server, "GangBroken")))
        assert "1 of the 2 members (minMember) are bound" in events(server, "GangBroken")[0]["message"]
        # the room b had is taken meanwhile by another pod
        del server.refuse["b"]
        service.on_pod("ADDED", server.put(PODS, pod_obj("c", gpus=2)))
        await settle(service, rounds=3)
        assert ("ns/c", "n1") in server.bindings
        for _ in range(40):  # b is retried after its backoff and fits nowhere
            service.queue.flush()
            await settle(service, rounds=2)
            if any("1 more must join them" in e["message"] for e in events(server, "FailedScheduling")):
                break
        failed = [e["message"] for e in events(server, "FailedScheduling")]
        assert any("1 of the 2 members (minMember) are bound and 1 more must join them" in m for m in failed), failed
        assert not any("0 of the 1 members it needs" in m for m in failed), failed
        await asyncio.sleep(1.0)  # the group's scheduleTimeoutSeconds
        service.gang_upkeep.release_broken()
        await until(lambda: any(p.endswith("/pods/a/eviction") for _, p, _ in server.written))
        released = events(server, "GangReleased")
        assert any(e["involvedObject"]["kind"] == "PodGroup" for e in released)
        assert not any(p.endswith("/pods/c/eviction") for _, p, _ in server.written)
        service.gang_upkeep.release_broken()  # once: nothing more is evicted
        await asyncio.sleep(0.2)
        assert sum(p.endswith("/eviction") for _, p, _ in server.written) == 1
        await service.recorder.stop()

    asyncio.run(with_service(test))


def test_a_gang_made_whole_again_is_not_released() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.on_node("ADDED", node_obj("n1"))
        service.on_pod_group("ADDED", {"metadata": {"name": "g", "namespace": "ns", "uid": "g-1"},
                                       "spec": {"minMember": 2, "scheduleTimeoutSeconds": 1}})
        server.refuse["b"] = 403
        service.on_pod("ADDED", server.put(PODS, member("a", 2)))
        service.on_pod("ADDED", server.put(PODS, member("b", 2)))
        await settle(service, rounds=3)
        del server.refuse["b"]
        for _ in range(60):  # b is retried alone and fits: the gang is whole again
            service.queue.flush()
            await settle(service, rounds=2)
            if ("ns/b", "n1") in server.bindings:
                break
        assert ("ns/b", "n1") in server.bindings
        await asyncio.sleep(1.0)
        service.gang_upkeep.release_broken()
        await asyncio.sleep(0.2)
        assert not any(p.endswith("/eviction") for _, p, _ in server.written)

    asyncio.run(with_service(test))
