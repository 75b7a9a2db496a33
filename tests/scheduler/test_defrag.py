"""The consolidate action through the real service (issue 19): the seed case, step by step.

Eight Deployment tenants of 10 memory units fill the eight 44-unit GPUs of two l40s nodes one each, so
no GPU has room for a 35-unit pod though the pool has 272 units free. The service moves one tenant: its
destination is reserved before the eviction, the blocked pod is nominated where it leaves, both sides
get Events; the ReplicaSet's replacement lands on the reservation and the blocked pod on the freed GPU.
The API server is the HTTP stand-in (tests/support/apiserver.py): what the service writes is recorded.
The same story on the real control plane with kube-controller-manager: tests/e2e/test_defrag.py.
A Job's pods move the same way when the Job's podFailurePolicy ignores DisruptionTarget first, and not
otherwise (the rule itself: tests/scheduler/test_movable_jobs.py)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.reservations import reservation_uid, same_request
from gpupool_sched.framework.plugins.movers import JOBS, DefragConfig
from gpupool_sched.kube import migration_record
from gpupool_sched.scheduler.service import PDBS, PRIORITY_CLASSES, SchedulerConfig, SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer, serving
from tests.support.objects import node_obj, pod_obj

MEM = "nvidia.com/gpu-memory"
_names = itertools.count()


def owned(obj: dict[str, Any], owner: str = "tenants") -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                           "uid": f"rs-{owner}", "controller": True}]
    return obj


def job_owned(obj: dict[str, Any], uid: str = "job-train") -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": uid,
                                           "controller": True}]
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
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces", JOBS):
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


# ---- failover: the holds live on the blocked pod (gpupool.io/migration) -----------------------------------
def where(p: Any) -> tuple[Any, ...]:
    """A placement's devices (the record carries no score)."""
    return p.node, p.gpu_indices, p.gpu_milli, p.gpu_memory_mib, p.mig_devices


def recorded(server: ApiServer, pod: dict[str, Any], node: str) -> dict[str, Any]:
    """`pod` as the API server holds it after the leader's writes: its migration record and nomination."""
    out = copy.deepcopy(pod)
    for method, path, body in server.written:
        if method == "PATCH" and path.endswith(f"/pods/{pod['metadata']['name']}"):
            out["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
    out["status"]["nominatedNodeName"] = node
    out["metadata"]["resourceVersion"] = server.version()
    return out


def terminating(server: ApiServer, pod: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["metadata"]["deletionTimestamp"] = "2026-12-02T10:00:00Z"
    out["metadata"]["resourceVersion"] = server.version()
    return out


async def leader_moves_one(service: SchedulerService, server: ApiServer) -> tuple[
        list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The seed case up to the eviction on `service`: (tenants, big, the mover)."""
    tenants = seed(service, server)
    big = add(service, server, pod_obj("big", units=35))
    await run_queue(service, rounds=5)
    moved = evictions(server)
    assert len(moved) == 1, server.written
    return tenants, big, next(t for t in tenants if t["metadata"]["name"] == moved[0])


def test_the_holds_are_recorded_on_the_blocked_pod_before_any_eviction() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        _, big, mover = await leader_moves_one(service, server)
        writes = [(m, p) for m, p, _ in server.written]
        record_at = writes.index(("PATCH", "/api/v1/namespaces/ns/pods/big"))
        evict_at = writes.index(("POST", f"/api/v1/namespaces/ns/pods/{mover['metadata']['name']}/eviction"))
        assert record_at < evict_at
        record = migration_record.record_of(recorded(server, big, mover["spec"]["nodeName"]))
        assert record is not None and record.node == mover["spec"]["nodeName"]
        held = service.state.reservations[reservation_uid(mover["metadata"]["uid"])]
        (move,) = record.moves
        assert (move.mover, move.owner, where(move.destination)) == (held.mover, held.owner, where(held.destination))
        assert same_request(move.request, held.request) and move.request.priority == held.request.priority
        assert record.until > time.time() + 60  # the mover's grace, the slack and the replacement window

    asyncio.run(with_service(test))


def test_a_new_leader_holds_what_the_old_one_held_and_the_replacement_lands_there() -> None:
    """The leader evicts the mover and dies; a new scheduler starts from the API server's objects: it holds
    the recorded destination for the replacement and the freed room for the blocked pod, and finishes the
    plan. (Before the record existed the new leader knew of no hold: the first assertion failed.)"""
    async def test(old: SchedulerService, server: ApiServer) -> None:
        tenants, big, mover = await leader_moves_one(old, server)
        held = old.state.reservations[reservation_uid(mover["metadata"]["uid"])].destination
        config = SchedulerConfig(defrag=DefragConfig(after_s=0.0, min_runtime_s=0.0))
        new = SchedulerService(config, old.api)
        new.recorder.start()
        try:
            for name in ("n1", "n2"):
                new.on_node("ADDED", server.objects[NODES][f"/{name}"])
            for t in tenants:
                new.on_pod("ADDED", terminating(server, t) if t is mover else t)
            new.on_pod("ADDED", recorded(server, big, mover["spec"]["nodeName"]))
            adopted = new.state.reservations.get(reservation_uid(mover["metadata"]["uid"]))
            assert adopted is not None and adopted.adopted and where(adopted.destination) == where(held)
            assert new.state.nominations[big["metadata"]["uid"]].victims == {mover["metadata"]["uid"]}
            new.state.abandon_unstarted()  # what its housekeeping does as leader: the mover is going, it stays
            assert reservation_uid(mover["metadata"]["uid"]) in new.state.reservations

            server.delete(PODS, mover)
            gone = terminating(server, mover)
            new.on_pod("DELETED", gone)
            replacement = add(new, server, owned(pod_obj("tenants-new", units=10)))
            await run_queue(new, rounds=60, until=lambda: len(server.bindings) == 2)
            bound = dict(server.bindings)
            assert bound["ns/big"] == mover["spec"]["nodeName"] and bound["ns/tenants-new"] == held.node
            placed = new.state.pods[replacement["metadata"]["uid"]].placement
            assert (placed.node, placed.gpu_indices) == (held.node, held.gpu_indices)
            assert not new.state.reservations
            snap = new.state.snapshot
            assert (snap.gpu_mem_free[snap.gpu_usable] >= 0).all()
            assert len(evictions(server)) == 1  # the new leader evicted nobody
        finally:
            await new.recorder.stop()
            await new.informers.stop()
            await new.binder.drain()

    asyncio.run(with_service(test))


def test_a_standby_mirrors_the_holds_and_lets_go_when_the_replacement_is_bound() -> None:
    """A standby reads the record as the leader writes it; when the leader's replacement shows up bound on
    the destination, the mirrored hold ends before the replacement is accounted (nothing counted twice).
    A recorded mover that was never evicted is let go once the standby leads."""
    async def test(leader: SchedulerService, server: ApiServer) -> None:
        tenants, big, mover = await leader_moves_one(leader, server)
        held = leader.state.reservations[reservation_uid(mover["metadata"]["uid"])].destination
        standby = SchedulerService(SchedulerConfig(defrag=DefragConfig(after_s=0.0, min_runtime_s=0.0)),
                                   leader.api)
        for name in ("n1", "n2"):
            standby.on_node("ADDED", server.objects[NODES][f"/{name}"])
        for t in tenants:
            standby.on_pod("ADDED", t)
        snap = standby.state.snapshot
        row = snap.row_of(held.node)
        free_before = int(snap.gpu_mem_free[row, held.gpu_indices[0]])
        standby.on_pod("MODIFIED", recorded(server, big, mover["spec"]["nodeName"]))
        hold = standby.state.pods[reservation_uid(mover["metadata"]["uid"])]
        assert hold.phase is Phase.RESERVED and where(hold.placement) == where(held)
        assert int(snap.gpu_mem_free[row, held.gpu_indices[0]]) == free_before - held.gpu_memory_mib

        # the leader binds the replacement where it held room: the standby sees it bound
        replacement = owned(pod_obj("tenants-new", units=10))
        uuid = standby.state.nodes[held.node].spec.gpus[held.gpu_indices[0]].uuid
        ack = AllocationAck(node=held.node, pod_uid=replacement["metadata"]["uid"], complete=True,
                            containers={"main": {MEM: tuple(f"{uuid}::{k}" for k in range(10))}})
        replacement["metadata"]["annotations"].update(ack_annotations(ack))
        replacement["spec"]["nodeName"] = held.node
        standby.on_pod("MODIFIED", terminating(server, mover))
        standby.on_pod("ADDED", server.put(PODS, replacement))
        assert reservation_uid(mover["metadata"]["uid"]) not in standby.state.reservations
        assert int(snap.gpu_mem_free[row, held.gpu_indices[0]]) == free_before - \
            standby.state.pods[replacement["metadata"]["uid"]].placement.gpu_memory_mib
        assert standby.state.replaced[replacement["metadata"]["uid"]] == mover["metadata"]["uid"]

        # a record whose mover was never evicted (the leader died first): held while standing by,
        # let go once leading
        other = next(t for t in tenants if t is not mover and t["spec"]["nodeName"] != held.node)
        fake = copy.deepcopy(recorded(server, big, mover["spec"]["nodeName"]))
        fake["metadata"]["uid"] = "blocked-2"
        fake["metadata"]["name"] = "big-2"
        record = migration_record.record_of(fake)
        assert record is not None
        (move,) = record.moves
        spec = standby.state.pods[other["metadata"]["uid"]]
        move2 = migration_record.RecordedMove(other["metadata"]["uid"], spec.key, spec.owner, spec.request,
                                              move.destination)
        fake["metadata"]["annotations"][migration_record.MIGRATION_ANNOTATION] = migration_record.encode(
            migration_record.MigrationRecord(record.node, record.at, record.until, (move2,)))
        standby.on_pod("ADDED", fake)
        assert reservation_uid(other["metadata"]["uid"]) in standby.state.reservations
        assert [r.mover for r in standby.state.abandon_unstarted()] == [other["metadata"]["uid"]]
        assert not standby.state.reservations
        await standby.informers.stop()

    asyncio.run(with_service(test))


IGNORE_DISRUPTION = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
FAIL_ON_ERRORS = {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "NotIn", "values": [0]}}


async def seed_job(service: SchedulerService, server: ApiServer, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seed case with a Job's eight pods for tenants; the Job (with `rules` for its podFailurePolicy,
    none when empty) comes in through the service's LIST of the kinds it watches."""
    spec: dict[str, Any] = {"template": {"spec": {"restartPolicy": "Never"}}}
    if rules:
        spec["podFailurePolicy"] = {"rules": rules}
    server.put(JOBS, {"apiVersion": "batch/v1", "kind": "Job", "spec": spec,
                      "metadata": {"namespace": "ns", "name": "train", "uid": "job-train"}})
    await service.resync()
    for name in ("n1", "n2"):
        service.on_node("ADDED", server.put(NODES, node_obj(name)))
    return [add(service, server, job_owned(tenant(service, node, gpu, owner="train")))
            for node in ("n1", "n2") for gpu in range(4)]


def test_a_jobs_pod_moves_when_its_job_ignores_disruptions() -> None:
    """A Job whose podFailurePolicy ignores DisruptionTarget makes a new pod for an evicted one and counts
    nothing against it: its pods move as a ReplicaSet's do, and its replacement takes the held destination."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = await seed_job(service, server, [IGNORE_DISRUPTION, FAIL_ON_ERRORS])
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=5)

        moved = evictions(server)
        assert len(moved) == 1, server.written
        mover = next(t for t in tenants if t["metadata"]["name"] == moved[0])
        mover_uid = mover["metadata"]["uid"]
        reservation = service.state.reservations[reservation_uid(mover_uid)]
        assert service.state.nominations[big["metadata"]["uid"]].node == mover["spec"]["nodeName"]
        assert len(events(server, "Consolidating")) == 1 and len(events(server, "Moved")) == 1

        # the evicted pod fails; the Job ignores it and makes a new pod of the same shape
        server.delete(PODS, mover)
        gone = copy.deepcopy(mover)
        gone["metadata"]["resourceVersion"] = server.version()
        service.on_pod("DELETED", gone)
        add(service, server, job_owned(pod_obj("train-new", units=10)))
        await run_queue(service, rounds=60, until=lambda: len(server.bindings) == 2)
        bound = dict(server.bindings)
        assert bound["ns/big"] == mover["spec"]["nodeName"]
        assert bound["ns/train-new"] == reservation.destination.node
        assert not service.state.reservations
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "replaced"}) == 1

    asyncio.run(with_service(test))


@pytest.mark.parametrize("rules", [
    pytest.param([], id="no-pod-failure-policy"),
    # the evicted pod's exit code (143 after SIGTERM) would fail the Job before the Ignore rule is reached
    pytest.param([FAIL_ON_ERRORS, IGNORE_DISRUPTION], id="failjob-on-exit-codes-first"),
])
def test_a_jobs_pod_stays_when_its_job_does_not_ignore_disruptions(rules: list[dict[str, Any]]) -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        await seed_job(service, server, rules)
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == [] and not service.state.reservations
        assert big["metadata"]["uid"] not in service.state.pods and not service.defrag.due
        assert events(server, "FailedScheduling") and not events(server, "Consolidating")
        assert all(e.phase is Phase.CONFIRMED and e.evicting_for is None for e in service.state.pods.values())

    asyncio.run(with_service(test))
