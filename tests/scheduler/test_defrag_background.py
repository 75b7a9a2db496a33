"""Background consolidation through the real service (issue 19, section 3): with no pod waiting for GPUs,
tenants spread one per GPU are gathered so that whole GPUs come free, one migration at a time, each tenant's
destination held before its eviction; a real pending GPU pod stops it, the replacement of a move does not;
the modes (off, idle after a quiet time, a UTC window) decide when. The API server is the HTTP stand-in.
On the real control plane: tests/e2e/test_defrag_background.py."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from gpupool_sched.cache.reservations import reservation_uid
from gpupool_sched.framework.plugins.defrag_config import DefragConfig, in_window, parse_window
from gpupool_sched.placement.background import free_gpus
from gpupool_sched.scheduler.defrag import PURPOSE
from gpupool_sched.scheduler.service import SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer
from tests.support.defrag_service import add, events, evictions, owned, run_queue, seed, tenant, with_service
from tests.support.objects import node_obj, pod_obj

IDLE = {"background": "idle", "background_quiet_s": 0.0, "per_hour": 10}


def tick(service: SchedulerService) -> Any:
    """One housekeeping tick of the background mode, as the service runs it."""
    return service.defrag.background(True, service._waiting_for_gpus())


def test_idle_gathers_one_gpu_at_a_time_with_the_destination_held_before_the_eviction() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = seed(service, server)  # 8 tenants of 10 units, one per 44-unit GPU
        assert free_gpus(service.state.snapshot) == 0
        found = tick(service)
        assert found is not None and len(found.moves) == 1 and found.free_gpus_after == 1
        move = found.moves[0]
        uid = move.pod.uid
        # held before anything is sent: marked as moving, its destination reserved for its replacement
        assert service.state.pods[uid].evicting_for == f"{PURPOSE}1"
        reservation = service.state.reservations[reservation_uid(uid)]
        assert reservation.blocked == f"{PURPOSE}1" and reservation.destination == move.destination
        assert service.state.migrating_nodes() == {move.pod.node, move.destination.node}, "both ends are busy"
        assert tick(service) is None, "one background migration at a time"
        await service.defrag.migrator.drain()
        await service.recorder.flush()
        mover = next(t for t in tenants if t["metadata"]["uid"] == uid)
        assert evictions(server) == [mover["metadata"]["name"]]
        consolidating = events(server, "Consolidating")
        assert len(consolidating) == 1 and f"to node {move.destination.node}" in consolidating[0]["message"]
        assert "whole free GPUs 0 -> 1" in consolidating[0]["message"]
        assert len(events(server, "Moved")) == 1
        assert tick(service) is None, "still one at a time: the replacement has not come"

        # the mover goes, its ReplicaSet's replacement (pending) is no real pod waiting: it takes the room held
        server.delete(PODS, mover)
        gone = copy.deepcopy(mover)
        gone["metadata"]["resourceVersion"] = server.version()
        service.on_pod("DELETED", gone)
        replacement = add(service, server, owned(pod_obj("tenants-new", units=10)))
        assert not service._waiting_for_gpus(), "a replacement of a background move is no real pod waiting"
        await run_queue(service, rounds=20, until=lambda: len(server.bindings) == 1)
        placed = service.state.pods[replacement["metadata"]["uid"]].placement
        assert (placed.node, placed.gpu_indices) == (move.destination.node, move.destination.gpu_indices)
        assert not service.state.reservations and free_gpus(service.state.snapshot) == 1
        value = service.metrics.registry.get_sample_value
        for result in ("planned", "evicted", "replaced"):
            assert value("gpupool_scheduler_migrations_total", {"reason": "background", "result": result}) == 1
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "evicted"}) == 0
        assert value("gpupool_scheduler_defrag_gpus_freed_total", {"reason": "background"}) == 1

        # the next one may come now; the budget (10 per hour) and min-runtime 0 allow it
        nxt = tick(service)
        assert nxt is not None and nxt.free_gpus_before == 1 and nxt.free_gpus_after == 2
        assert nxt.moves[0].pod.uid != replacement["metadata"]["uid"], "a replacement is in its cooldown"

    asyncio.run(with_service(test, **IDLE))


def test_a_real_pod_waiting_for_gpus_stops_background_moves() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        add(service, server, pod_obj("real", units=40))  # fits nowhere: it waits
        assert service._waiting_for_gpus()
        assert tick(service) is None and service.metrics.defrag_background_allowed._value.get() == 0
        await service.defrag.migrator.drain()
        assert evictions(server) == [] and not service.state.reservations

    asyncio.run(with_service(test, **IDLE))


def test_a_pod_that_starts_waiting_mid_migration_spares_the_movers_not_evicted_yet() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        found = tick(service)
        assert found is not None
        service.defrag.waiting = True  # the next tick saw a real pod before the eviction went out
        await service.defrag.migrator.drain()
        assert evictions(server) == [] and not service.state.reservations
        assert service.state.pods[found.moves[0].pod.uid].evicting_for is None, "spared"
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "background", "result": "abandoned"}) == 1
        service.defrag.tick()
        assert not service.defrag.freeing, "a migration that stopped frees nothing"
        assert value("gpupool_scheduler_defrag_gpus_freed_total", {"reason": "background"}) == 0

    asyncio.run(with_service(test, **IDLE))


def test_pods_of_another_scheduler_are_not_moved() -> None:
    """Their replacements would be placed by that scheduler, never on the room held for them."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        for node in ("n1", "n2"):
            for gpu in range(4):
                obj = tenant(service, node, gpu)
                obj["spec"]["schedulerName"] = "default-scheduler"
                add(service, server, obj)
        assert len(service.state.pods) == 8 and not any(e.ours for e in service.state.pods.values())
        assert len(service.defrag.movers.movable) == 8, "movable by kind: only the scheduler differs"
        assert service.defrag.movers.candidates(2**31) == [], "never a candidate: another scheduler places it"
        assert tick(service) is None and not service.state.reservations

    asyncio.run(with_service(test, **IDLE))


@pytest.mark.parametrize("mode", ["off", "quiet"])
def test_nothing_moves_when_off_or_before_the_quiet_time(mode: str) -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        assert tick(service) is None and tick(service) is None
        await service.defrag.migrator.drain()
        assert evictions(server) == [] and not service.state.reservations

    kw = {"background": "off"} if mode == "off" else {**IDLE, "background_quiet_s": 600.0}
    asyncio.run(with_service(test, **kw))


def test_window_mode_moves_inside_its_utc_window_only() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        service.defrag.utcnow = lambda: datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
        assert tick(service) is None, "noon is outside 22:00-06:00"
        service.defrag.utcnow = lambda: datetime(2026, 12, 2, 23, 30, tzinfo=UTC)
        assert tick(service) is not None

    asyncio.run(with_service(test, background="window", background_window=parse_window("22:00-06:00"),
                             per_hour=10))


def test_windows_and_config_checks() -> None:
    assert parse_window("22:00-06:00") == (1320, 360)
    assert in_window((1320, 360), 23 * 60) and in_window((1320, 360), 5 * 60) and not in_window((1320, 360), 720)
    assert in_window((60, 120), 90) and not in_window((60, 120), 120) and in_window((0, 0), 999)
    for bad in ("22:00", "24:00-01:00", "aa:bb-cc:dd", "10:60-11:00"):
        with pytest.raises(ValueError):
            parse_window(bad)
    with pytest.raises(ValueError):
        DefragConfig(background="sometimes")
    with pytest.raises(ValueError):
        DefragConfig(background="window")
    with pytest.raises(ValueError):
        DefragConfig(enabled=False, background="idle")
    assert DefragConfig().background == "off", "off by default"
