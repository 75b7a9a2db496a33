"""A Binding whose answer is lost: the scheduler keeps the pod's devices until a read of the pod says
whether it landed (issue 16 A2). The service talks HTTP to tests/support/apiserver.py, which commits
Bindings and then loses the answer on command (a 5xx, a dropped connection)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from gpupool_sched.writer.binder import definitely_unbound
from tests.support.apiserver import PODS, ApiServer, serving, settle
from tests.support.objects import bump, node_obj, pod_obj


async def run_service(test: Callable[[SchedulerService, ApiServer], Awaitable[None]]) -> None:
    async with serving() as (server, api):
        service = SchedulerService(SchedulerConfig(), api)
        service.on_node("ADDED", node_obj("n1"))  # 4 GPUs
        try:
            await test(service, server)
        finally:
            await service.binder.drain()


def add_pod(service: SchedulerService, server: ApiServer, obj: dict[str, Any]) -> str:
    service.on_pod("ADDED", server.put(PODS, obj))
    return str(obj["metadata"]["uid"])


async def schedule_all(service: SchedulerService) -> None:
    await settle(service)


def free_gpus(service: SchedulerService) -> int:
    i = service.state.snapshot.index["n1"]
    return int((service.state.snapshot.free_milli[i, :4] >= 1000).sum())


def test_only_definite_answers_free_a_binding() -> None:
    assert definitely_unbound(ApiError(404, "NotFound", "gone"))
    assert definitely_unbound(ApiError(422, "Invalid", "bad"))
    assert definitely_unbound(ApiError(0, "NotLeader", "lost leadership before the bind"))
    assert not definitely_unbound(ApiError(0, "TimeoutError", ""))
    assert not definitely_unbound(ApiError(504, "Timeout", ""))
    assert not definitely_unbound(ApiError(500, "InternalError", ""))
    assert not definitely_unbound(ApiError(409, "Conflict", "pod a is already assigned to node n1"))


def _lost_answer_keeps_the_gpus(answer: str | int) -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.answer = answer
        a = add_pod(service, server, pod_obj("a", gpus=4))
        await schedule_all(service)
        assert server.bindings == [("ns/a", "n1")]
        # the answer was lost, the Binding landed: a still holds all 4 GPUs
        assert a in service.state.pods and free_gpus(service) == 0
        assert server.reads >= 1, "nobody read the pod to learn the outcome"
        server.answer = "ok"
        add_pod(service, server, pod_obj("b", gpus=1))
        await schedule_all(service)
        assert server.bindings == [("ns/a", "n1")], "b was given a GPU that a holds"
        entry = service.state.pods[a]
        assert entry.phase is Phase.CONFIRMED and not entry.uncertain

    asyncio.run(run_service(test))


def test_a_gateway_timeout_after_commit_keeps_the_gpus() -> None:
    _lost_answer_keeps_the_gpus(504)


def test_a_dropped_connection_after_commit_keeps_the_gpus() -> None:
    _lost_answer_keeps_the_gpus("lost")


def test_a_lost_answer_of_a_binding_that_did_not_land_is_retried() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.answer, server.commit = 503, False
        a = add_pod(service, server, pod_obj("a", gpus=4))
        await schedule_all(service)
        assert server.bindings == [] and a not in service.state.pods  # read unbound: forgotten
        assert free_gpus(service) == 4
        server.answer, server.commit = "ok", True
        service.queue.flush()
        for _ in range(100):
            service.queue.flush()
            await schedule_all(service)
            if server.bindings:
                break
            await asyncio.sleep(0.05)
        assert server.bindings == [("ns/a", "n1")]

    asyncio.run(run_service(test))


def test_an_error_after_the_watch_showed_the_pod_bound_keeps_it_confirmed() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.answer = 504
        obj = pod_obj("a", gpus=4)
        a = add_pod(service, server, obj)
        item = service.queue.pop()
        assert item is not None
        service.schedule_one(item)
        # the watch shows the pod bound before the Binding's (failed) answer comes back
        service.on_pod("MODIFIED", bump(server.objects[PODS]["ns/a"], node="n1"))
        await schedule_all(service)
        entry = service.state.pods.get(a)
        assert entry is not None and entry.phase is Phase.CONFIRMED and free_gpus(service) == 0

    asyncio.run(run_service(test))


def test_a_conflict_keeps_the_gpus_until_the_pod_is_read() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        obj = pod_obj("a", gpus=4)
        a = add_pod(service, server, obj)
        server.put(PODS, bump(obj, node="n1"))  # bound already (an earlier attempt's Binding)
        await schedule_all(service)
        entry = service.state.pods.get(a)
        assert entry is not None and entry.node == "n1" and free_gpus(service) == 0
        assert entry.phase is Phase.CONFIRMED

    asyncio.run(run_service(test))


def test_a_bound_pod_never_seen_bound_is_read_not_forgotten() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        a = add_pod(service, server, pod_obj("a", gpus=4))
        await schedule_all(service)
        entry = service.state.pods[a]
        assert entry.phase is Phase.BOUND
        entry.since -= service.state.confirm_ttl_s + 1  # the watch never showed it (a gap)
        service._verify_unconfirmed()
        await schedule_all(service)
        entry = service.state.pods[a]
        assert entry.phase is Phase.CONFIRMED and free_gpus(service) == 0

    asyncio.run(run_service(test))
