"""The consolidate action through the real service (issue 19): the seed case, step by step.

Eight Deployment tenants of 10 memory units fill the eight 44-unit GPUs of two l40s nodes one each, so
no GPU has room for a 35-unit pod though the pool has 272 units free. The service moves one tenant: its
destination is reserved before the eviction, the blocked pod is nominated where it leaves, both sides
get Events; the ReplicaSet's replacement lands on the reservation and the blocked pod on the freed GPU.
The API server is the HTTP stand-in (tests/support/apiserver.py): what the service writes is recorded.
The same story on the real control plane with kube-controller-manager: tests/e2e/test_defrag.py."""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.reservations import reservation_uid
from gpupool_sched.framework.plugins.movers import DefragConfig
from gpupool_sched.scheduler.service import PDBS, PRIORITY_CLASSES, SchedulerConfig, SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer, serving
from tests.support.objects import node_obj, pod_obj

MEM = "nvidia.com/gpu-memory"
_names = itertools.count()


def owned(obj: dict[str, Any], owner: str = "tenants") -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                           "uid": f"rs-{owner}", "controller": True}]
    return obj


def tenant(service: SchedulerService, node: str, gpu: int, units: int = 10, owner: str = "tenants") -> dict[str, Any]:
    """A running ReplicaSet pod of `units` memory units on GPU `gpu` of `node` (the plugin's ack says which)."""
    obj = owned(pod_obj(f"{owner}-{next(_names)}", units=units, node=node, phase="Running"), owner)
    uuid = service.state.nodes[node].spec.gpus[gpu].uuid
    ack = AllocationAck(node=node, pod_uid=obj["metadata"]["uid"], complete=True,
                        containers={"main": {MEM: tuple(f"{uuid}::{k}" for k in range(units))}})
    obj["metadata"]["annotations"].update(ack_annotations(ack))
    obj["status"]["startTime"] = "2026-11-30T10:00:00Z"
    return obj


async def with_service(test: Callable[[SchedulerService, ApiServer], Awaitable[None]], **defrag: Any) -> None:
    async with serving() as (server, api):
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces"):
            server.objects[path] = {}
        config = SchedulerConfig(defrag=DefragConfig(**{"after_s": 0.0, "min_runtime_s": 0.0, **defrag}))
        service = SchedulerService(config, api)
        service.recorder.start()  # Events and conditions are posted (the service starts it in `start`)
        try:
            await test(service, server)
        finally:
            await service.recorder.stop()
            await service.informers.stop()
            await service.binder.drain()
            await service.defrag.migrator.drain()


def add(service: SchedulerService, server: ApiServer, obj: dict[str, Any]) -> dict[str, Any]:
    stored = server.put(PODS, obj)
    service.on_pod("ADDED", stored)
    return stored


async def run_queue(service: SchedulerService, rounds: int = 30, until: Callable[[], bool] | None = None) -> None:
    """Decide for whatever is queued (eviction planning off the loop, as the service does), `rounds` times
    0.1 s apart (a retried pod waits out its backoff), letting Bindings, evictions and Events go out in
    between; earlier once `until()` holds."""
    for _ in range(rounds):
        service.queue.flush()
        while (item := service.queue.pop()) is not None:
            await service.scheduling.schedule_one_offloaded(item)
        await asyncio.sleep(0.1)
        await service.defrag.migrator.drain()
        if until is not None and until():
            break
    await service.binder.drain()
    await service.recorder.flush()


def evictions(server: ApiServer) -> list[str]:
    return [path.split("/")[-2] for method, path, _ in server.written
            if method == "POST" and path.endswith("/eviction")]


def events(server: ApiServer, reason: str) -> list[dict[str, Any]]:
    return [body for method, path, body in server.written
            if method == "POST" and path.endswith("/events") and body.get("reason") == reason]


def seed(service: SchedulerService, server: ApiServer) -> list[dict[str, Any]]:
    for name in ("n1", "n2"):
        service.on_node("ADDED", server.put(NODES, node_obj(name)))
    return [add(service, server, tenant(service, node, gpu)) for node in ("n1", "n2") for gpu in range(4)]


def test_the_seed_case_moves_one_tenant_with_its_destination_held_first() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = seed(service, server)
        big = add(service, server, pod_obj("big", units=35))
        big_uid = big["metadata"]["uid"]
        await run_queue(service, rounds=5)

        moved = evictions(server)
        assert len(moved) == 1, server.written
        mover = next(t for t in tenants if t["metadata"]["name"] == moved[0])
        mover_uid = mover["metadata"]["uid"]
        mover_gpus = service.state.pods[mover_uid].placement.gpu_indices
        # held before the eviction: the destination for its replacement, the blocked pod's nomination
        reservation = service.state.reservations[reservation_uid(mover_uid)]
        nomination = service.state.nominations[big_uid]
        assert nomination.node == mover["spec"]["nodeName"] and nomination.victims == {mover_uid}
        assert (reservation.destination.node, reservation.destination.gpu_indices) != (mover["spec"]["nodeName"],
                                                                                       mover_gpus)
        assert any(p.endswith("/pods/big/status") or p.endswith("/pods/big") for _, p, _ in server.written)
        consolidating = events(server, "Consolidating")
        assert len(consolidating) == 1 and moved[0] in consolidating[0]["message"]
        moved_event = events(server, "Moved")
        assert len(moved_event) == 1 and "ns/big" in moved_event[0]["message"]
        assert reservation.destination.node in moved_event[0]["message"]

        # the kubelet stops the mover; its ReplicaSet makes a replacement of the same shape
        server.delete(PODS, mover)
        gone = copy.deepcopy(mover)
        gone["metadata"]["resourceVersion"] = server.version()
        service.on_pod("DELETED", gone)
        replacement = add(service, server, owned(pod_obj("tenants-new", units=10)))
        await run_queue(service, rounds=60, until=lambda: len(server.bindings) == 2)

        bound = dict(server.bindings)
        assert bound["ns/big"] == mover["spec"]["nodeName"]
        assert bound["ns/tenants-new"] == reservation.destination.node
        placed = service.state.pods[replacement["metadata"]["uid"]].placement
        assert (placed.node, placed.gpu_indices) == (reservation.destination.node, reservation.destination.gpu_indices)
        assert service.state.pods[big_uid].placement.gpu_indices == mover_gpus  # the GPU the mover freed
        assert not service.state.reservations and big_uid not in service.state.nominations
        snap = service.state.snapshot
        assert (snap.gpu_mem_free[snap.gpu_usable] >= 0).all()
        # KAI's lesson: on the consolidated state nothing moves again
        await run_queue(service)
        assert len(evictions(server)) == 1
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "evicted"}) == 1
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "replaced"}) == 1

    asyncio.run(with_service(test))


def test_nothing_moves_before_the_pod_waited_defrag_after() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == []
        assert big["metadata"]["uid"] in service.defrag.due  # tried again once the wait is over

    asyncio.run(with_service(test, after_s=3600.0))


def test_a_spent_budget_is_said_and_nothing_moves() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        conditions = [body for method, path, body in server.written
                      if method == "PATCH" and path.endswith("/pods/big/status")]
        unschedulable = events(server, "FailedScheduling")
        assert evictions(server) == []
        assert unschedulable and "defragmentation budget (0 moves per hour) is spent" in unschedulable[-1]["message"]
        assert conditions

    asyncio.run(with_service(test, per_hour=0))


def test_bare_pods_and_pods_that_say_no_never_move() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        for node in ("n1", "n2"):
            for gpu in range(4):
                obj = tenant(service, node, gpu)
                if gpu % 2:
                    del obj["metadata"]["ownerReferences"]  # a bare pod
                else:
                    obj["metadata"]["annotations"]["gpupool.io/movable"] = "false"
                add(service, server, obj)
        add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == []
        assert all(e.phase is Phase.CONFIRMED and e.evicting_for is None for e in service.state.pods.values())

    asyncio.run(with_service(test))


def test_without_the_action_the_blocked_pod_waits() -> None:
    """The seed case with `--defrag off`: what the tests above show is the action's doing."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == [] and not service.state.reservations
        assert big["metadata"]["uid"] not in service.state.pods and not service.defrag.due
        assert events(server, "FailedScheduling") and not events(server, "Consolidating")

    asyncio.run(with_service(test, enabled=False))
