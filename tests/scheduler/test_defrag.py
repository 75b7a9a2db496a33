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
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.reservations import reservation_uid, same_request
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.movers import JOBS
from gpupool_sched.kube import migration_record
from gpupool_sched.kube.kubeapi import DELETION_COST
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from gpupool_sched.writer.surge_record import LOWEST_COST, MIGRATE, REVISION, SURGE_RECORD, SURGING, SurgeRecord
from tests.support.apiserver import NODES, PODS, ApiServer
from tests.support.defrag_service import (
    MEM,
    add,
    events,
    evictions,
    job_owned,
    owned,
    run_queue,
    seed,
    tenant,
    with_service,
)
from tests.support.objects import node_obj, pod_obj


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
        # the mover was alone on its GPU and joined another tenant: one whole GPU freed, once it was replaced
        assert value("gpupool_scheduler_defrag_gpus_freed_total", {"reason": "blocked"}) == 1
        assert not service.defrag.freeing

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


def test_pods_another_scheduler_places_never_move() -> None:
    """Their replacement is placed by the other scheduler, which knows nothing of the destination held
    for it: the room could be taken twice over, or the replacement land anywhere (on 7e05171 such a
    tenant was moved)."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        for node in ("n1", "n2"):
            for gpu in range(4):
                obj = tenant(service, node, gpu)
                obj["spec"]["schedulerName"] = "default-scheduler"
                add(service, server, obj)
        add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == [] and not service.state.reservations
        tenants = [e for e in service.state.pods.values() if e.key.startswith("ns/tenants-")]
        assert len(tenants) == 8 and not any(e.ours for e in tenants)

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


def urgent(name: str = "urgent", units: int = 35) -> dict[str, Any]:
    obj = pod_obj(name, units=units)
    obj["spec"]["priority"] = 1000  # the tenants' is 0: it may preempt any of them
    return obj


def test_a_pod_that_could_preempt_waits_for_the_move_instead() -> None:
    """Preemption comes after consolidation, never before: a pod of higher priority that a move would
    place does not preempt while it waits `--defrag-after`; it is tried again then (on 7e05171 it
    preempted a tenant on its first try)."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        pod = add(service, server, urgent())
        await run_queue(service, rounds=3)
        assert evictions(server) == [], "no tenant killed while a move could place the pod"
        assert not service.state.nominations
        assert pod["metadata"]["uid"] in service.defrag.due  # tried again once the wait is over
        said = events(server, "FailedScheduling")
        assert said and "not preempting" in said[-1]["message"], said
        value = service.metrics.registry.get_sample_value
        assert not value("gpupool_scheduler_preemption_victims_total")

    asyncio.run(with_service(test, after_s=3600.0))


def test_a_pod_that_no_move_can_place_preempts_at_once() -> None:
    """The other side: when no move would place it (the tenants are bare pods), the wait holds nothing
    back and the pod preempts on its first try."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        for node in ("n1", "n2"):
            for gpu in range(4):
                obj = tenant(service, node, gpu)
                del obj["metadata"]["ownerReferences"]  # bare: nothing recreates it
                add(service, server, obj)
        add(service, server, urgent())
        await run_queue(service, rounds=3)
        assert len(evictions(server)) == 1, "one bare tenant preempted at once"
        assert not events(server, "Consolidating")

    asyncio.run(with_service(test, after_s=3600.0))


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
            # the old leader's move counts here too: on the budget (1 move per hour by default here), and
            # the replacement stays in place for the cooldown (before, both lived in the old leader only)
            assert new.defrag.movers.budget_left() == 0
            assert replacement["metadata"]["uid"] not in {m.pod.uid for m in new.defrag.movers.candidates(0)}
            mark = server.objects[PODS]["ns/tenants-new"]["metadata"]["annotations"][migration_record.MOVED_ANNOTATION]
            assert migration_record.decode_moved(mark).mover == mover["metadata"]["uid"]
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


def restarted(server: ApiServer, api: Any, **defrag: Any) -> SchedulerService:
    """A scheduler started afresh (a restart, or a new leader) from what the API server holds."""
    new = SchedulerService(SchedulerConfig(defrag=DefragConfig(**{"after_s": 0.0, "min_runtime_s": 0.0, **defrag})),
                           api)
    for obj in server.objects[NODES].values():
        new.on_node("ADDED", obj)
    for obj in list(server.objects[PODS].values()):
        new.on_pod("ADDED", obj)
    return new


def test_a_restarted_scheduler_keeps_the_cooldown_and_counts_the_moves_of_the_hour() -> None:
    """The move is on the pods: the blocked pod's record lists the mover, the replacement's Binding marks it
    (gpupool.io/moved). A scheduler started afresh from the API's objects counts that move on its hourly
    budget and does not move the replacement within the cooldown. (Before, a restart forgot both: the
    replacement was a candidate again and the budget was whole.)"""
    async def test(old: SchedulerService, server: ApiServer) -> None:
        _, _, mover = await leader_moves_one(old, server)
        gone(old, server, mover)
        replacement = add(old, server, owned(pod_obj("tenants-new", units=10)))
        await run_queue(old, rounds=60, until=lambda: len(server.bindings) == 2)
        assert len(server.bindings) == 2
        new = restarted(server, old.api, per_hour=5)
        try:
            candidates = {m.pod.uid for m in new.defrag.movers.candidates(0)}
            assert replacement["metadata"]["uid"] not in candidates and len(candidates) == 7
            assert new.defrag.movers.budget_left() == 4
            # once the cooldown is over it may move again (the mark does not pin it for ever)
            later = restarted(server, old.api, per_hour=5, cooldown_s=0.0)
            assert replacement["metadata"]["uid"] in {m.pod.uid for m in later.defrag.movers.candidates(0)}
            await later.informers.stop()
        finally:
            await new.informers.stop()

    asyncio.run(with_service(test))


def test_a_statefulsets_pod_keeps_its_cooldown_by_name() -> None:
    """A StatefulSet's pod comes back with the same name (its ordinal): its cooldown follows the name, even
    when its new pod was not placed on the held room (nothing links the two UIDs then)."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        pods = []
        for gpu in range(4):
            obj = tenant(service, "n1", gpu)
            obj["metadata"]["ownerReferences"][0].update(kind="StatefulSet", name="db", uid="sts-db")
            pods.append(add(service, server, obj))
        movers = service.defrag.movers
        movers.carried_out([pods[0]["metadata"]["uid"]])
        gone(service, server, pods[0])  # evicted; the StatefulSet makes db-0 again (a new UID), placed anywhere
        again = tenant(service, "n1", 0)
        again["metadata"]["ownerReferences"][0].update(kind="StatefulSet", name="db", uid="sts-db")
        again["metadata"]["name"] = pods[0]["metadata"]["name"]
        again = add(service, server, again)
        candidates = {m.pod.uid for m in movers.candidates(0)}
        assert again["metadata"]["uid"] not in candidates and len(candidates) == 3
        # a restart reads the move back from the blocked pod's record: the name stays in place there too
        fresh = restarted(server, service.api, per_hour=5)
        fresh.defrag.movers.remember(pods[0]["metadata"]["uid"], pods[0]["metadata"]["uid"],
                                     f"ns/{pods[0]['metadata']['name']}", "StatefulSet/ns/db", time.time() - 60)
        assert again["metadata"]["uid"] not in {m.pod.uid for m in fresh.defrag.movers.candidates(0)}
        assert fresh.defrag.movers.budget_left() == 4
        await fresh.informers.stop()

    asyncio.run(with_service(test, per_hour=5))


def test_a_pod_held_back_by_the_cooldown_is_tried_again_when_it_ends() -> None:
    """Every tenant was moved a moment ago: the blocked pod waits, and is tried again when the cooldown
    ends (before, only a cluster event or the queue's 5-minute flush tried it again: `due` stayed empty)."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        tenants = seed(service, server)
        service.defrag.movers.carried_out(t["metadata"]["uid"] for t in tenants)
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == []
        due = service.defrag.due.get(big["metadata"]["uid"])
        assert due is not None and due <= service.queue.clock() + 1.5
        await asyncio.sleep(max(0.0, due - service.queue.clock()) + 0.05)
        service.defrag.tick()
        await run_queue(service, rounds=30, until=lambda: bool(evictions(server)))
        assert len(evictions(server)) == 1

    asyncio.run(with_service(test, cooldown_s=1.5, per_hour=100))


def test_a_pod_held_back_by_a_spent_budget_is_tried_again_when_a_move_expires() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        seed(service, server)
        service.defrag.movers.moves.append(service.queue.clock() - 3600.0 + 1.0)  # a move 59:59 ago
        big = add(service, server, pod_obj("big", units=35))
        await run_queue(service, rounds=3)
        assert evictions(server) == []
        due = service.defrag.due.get(big["metadata"]["uid"])
        assert due is not None and due <= service.queue.clock() + 1.0
        await asyncio.sleep(max(0.0, due - service.queue.clock()) + 0.05)
        service.defrag.tick()
        await run_queue(service, rounds=30, until=lambda: bool(evictions(server)))
        assert len(evictions(server)) == 1

    asyncio.run(with_service(test, per_hour=1))


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


# ---- make-before-break: gpupool.io/migrate: surge ----------------------------------------------------
REPLICA_SETS = "/apis/apps/v1/replicasets"
DEPLOYMENTS = "/apis/apps/v1/deployments"
HPAS = "/apis/autoscaling/v2/horizontalpodautoscalers"


def surge_deployment(server: ApiServer, replicas: int = 8, *, annotated: bool = True) -> None:
    """The tenants' ReplicaSet and its Deployment (annotated `gpupool.io/migrate: surge`), settled: every
    replica updated, no rollout under way; no HPA."""
    for path in (REPLICA_SETS, DEPLOYMENTS, HPAS):
        server.objects[path] = {}
    server.put(REPLICA_SETS, {
        "metadata": {"name": "tenants", "namespace": "ns", "uid": "rs-tenants", "annotations": {REVISION: "1"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "tenants",
                                          "uid": "dep-tenants", "controller": True}]},
        "spec": {"replicas": replicas}})
    server.put(DEPLOYMENTS, {
        "metadata": {"name": "tenants", "namespace": "ns", "uid": "dep-tenants", "generation": 1,
                     "annotations": {REVISION: "1", **({MIGRATE: "surge"} if annotated else {})}},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                   "readyReplicas": replicas}})


async def pump(service: SchedulerService, until: Callable[[], bool], seconds: float = 10.0) -> None:
    """Decide for whatever is queued while a surge runs (the migrator is not drained: it waits for a Ready
    replica), until `until()` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not until():
        assert loop.time() < deadline, "timed out"
        service.queue.flush()
        while (item := service.queue.pop()) is not None:
            await service.scheduling.schedule_one_offloaded(item)
        await asyncio.sleep(0.02)
    await service.recorder.flush()


def surge_writes(server: ApiServer) -> list[tuple[str, Any]]:
    """The surge's writes in order: ("scale", replicas) and ("cost", pod name) (the blocked pod's migration
    record, the other pod patch, is not the surge's)."""
    out: list[tuple[str, Any]] = []
    for method, path, body in server.written:
        if method == "PATCH" and path.endswith("/deployments/tenants/scale"):
            out.append(("scale", body["spec"]["replicas"]))
        elif (method == "PATCH" and "/pods/" in path and not path.endswith("/status")
              and migration_record.MIGRATION_ANNOTATION not in body["metadata"]["annotations"]):
            assert body["metadata"]["annotations"] == {DELETION_COST: str(LOWEST_COST)}
            out.append(("cost", path.rsplit("/", 1)[1]))
    return out


def ready(service: SchedulerService, server: ApiServer, name: str, started: str = "2026-11-30T11:00:00Z") -> None:
    """The kubelet reports the pod Running and Ready."""
    obj = copy.deepcopy(server.objects[PODS][f"ns/{name}"])
    obj["status"] = {"phase": "Running", "startTime": started,
                     "conditions": [{"type": "Ready", "status": "True"}]}
    service.on_pod("MODIFIED", server.put(PODS, obj))


def gone(service: SchedulerService, server: ApiServer, obj: dict[str, Any]) -> None:
    stored = server.objects[PODS][f"ns/{obj['metadata']['name']}"]
    server.delete(PODS, stored)
    last = copy.deepcopy(stored)
    last["metadata"]["resourceVersion"] = server.version()
    service.on_pod("DELETED", last)


async def surge_started(service: SchedulerService, server: ApiServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The seed case with a surge Deployment: the big pod waits, one tenant is chosen, the Deployment goes to 9
    and its ReplicaSet's new pod (the test plays the controllers) is placed on the held destination.
    Returns (the mover, the new replica)."""
    service.defrag.migrator.surger.poll_s = 0.02
    tenants = seed(service, server)
    surge_deployment(server)
    add(service, server, pod_obj("big", units=35))
    await pump(service, lambda: server.replicas == [9])
    assert evictions(server) == []
    (mover_uid,) = [r.mover for r in service.state.reservations.values()]
    mover = next(t for t in tenants if t["metadata"]["uid"] == mover_uid)
    destination = service.state.reservations[reservation_uid(mover_uid)].destination
    consolidating = events(server, "Consolidating")
    assert len(consolidating) == 1 and f"{mover['metadata']['name']} (to {destination.node}, by surge)" in \
        consolidating[0]["message"]
    new = owned(pod_obj("tenants-new", units=10))
    new["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # since the surge
    new = add(service, server, new)
    await pump(service, lambda: "ns/tenants-new" in dict(server.bindings))
    placed = service.state.pods[new["metadata"]["uid"]].placement
    assert (placed.node, placed.gpu_indices) == (destination.node, destination.gpu_indices)
    return mover, new


def test_a_surge_deployment_moves_make_before_break() -> None:
    """Scale up, the new replica on the held destination, Ready; only then the mover's deletion cost and the
    scale back down; the big pod lands where the mover was. Without the annotation the tenant is evicted
    (the seed case above): the first assertion of `surge_started` fails."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        mover, _ = await surge_started(service, server)
        big_uid = server.objects[PODS]["ns/big"]["metadata"]["uid"]
        await asyncio.sleep(0.3)  # not Ready yet: nothing more is written, the mover runs on
        assert surge_writes(server) == [("scale", 9)]
        assert mover["metadata"]["uid"] in service.state.pods and big_uid in service.state.nominations

        ready(service, server, "tenants-new")
        await pump(service, lambda: len(surge_writes(server)) == 3)
        assert surge_writes(server) == [("scale", 9), ("cost", mover["metadata"]["name"]), ("scale", 8)]
        assert server.objects[DEPLOYMENTS]["ns/tenants"]["spec"]["replicas"] == 8
        await service.defrag.migrator.drain()  # the surge's record goes once the count is back
        rs = server.objects[REPLICA_SETS]["ns/tenants"]
        assert SURGE_RECORD not in rs["metadata"]["annotations"] and SURGING not in rs["metadata"]["labels"]
        assert server.objects[DEPLOYMENTS]["ns/tenants"]["metadata"]["generation"] == 3  # two scales, no more
        assert evictions(server) == []
        # the ReplicaSet removes the pod of lowest cost: the mover; the big pod takes its GPU
        mover_gpus = service.state.pods[mover["metadata"]["uid"]].placement.gpu_indices
        gone(service, server, mover)
        await pump(service, lambda: "ns/big" in dict(server.bindings))
        assert dict(server.bindings)["ns/big"] == mover["spec"]["nodeName"]
        assert service.state.pods[big_uid].placement.gpu_indices == mover_gpus
        assert not service.state.reservations and not service.state.nominations and not service.state.surging
        moved = events(server, "Moved")
        assert len(moved) == 1 and "Moved by surge" in moved[0]["message"] and "tenants-new" in moved[0]["message"]
        on_deployment = [e for e in server.written if e[0] == "POST" and e[1].endswith("/events")
                         and e[2]["involvedObject"]["kind"] == "Deployment"]
        assert [e[2]["reason"] for e in on_deployment] == ["Surging", "Surged"]
        value = service.metrics.registry.get_sample_value
        for result, count in (("surged", 1), ("replaced", 1), ("evicted", 0), ("rolled_back", 0)):
            assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": result}) == count
        await run_queue(service, rounds=5)  # the consolidated state moves nothing more
        assert len(surge_writes(server)) == 3 and evictions(server) == []

    asyncio.run(with_service(test, surge_timeout_s=30.0))


def test_a_surge_whose_new_replica_is_not_ready_in_time_is_rolled_back() -> None:
    """--defrag-surge-timeout: the new replica gets the lowest deletion cost and the count goes back, so the
    ReplicaSet removes it, not the mover; the big pod is told why, and the Deployment is not surged again
    within the cooldown (its pods are not planned as movers)."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        mover, new = await surge_started(service, server)
        big_uid = server.objects[PODS]["ns/big"]["metadata"]["uid"]
        await pump(service, lambda: len(surge_writes(server)) == 3)
        assert surge_writes(server) == [("scale", 9), ("cost", "tenants-new"), ("scale", 8)]
        assert DELETION_COST not in server.objects[PODS][f"ns/{mover['metadata']['name']}"]["metadata"]["annotations"]
        await pump(service, lambda: bool(events(server, "ConsolidationFailed")))
        failed = events(server, "ConsolidationFailed")
        assert "by surge" in failed[0]["message"] and "not Ready within 2s" in failed[0]["message"]
        assert events(server, "NotMoved") and not events(server, "Moved") and evictions(server) == []
        entry = service.state.pods[mover["metadata"]["uid"]]
        assert entry.evicting_for is None  # spared: it runs on
        assert big_uid not in service.state.nominations and not service.state.reservations
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "rolled_back"}) == 1
        assert set(service.defrag.movers.refused) == {"ReplicaSet/ns/tenants"}  # not surged again for a while
        gone(service, server, new)  # the ReplicaSet removes the new replica
        await run_queue(service, rounds=5)
        assert len(surge_writes(server)) == 3 and evictions(server) == []

    asyncio.run(with_service(test, surge_timeout_s=2.0))


def test_a_surge_is_rolled_back_when_the_blocked_pod_goes_and_retries_a_conflict() -> None:
    """A conflict (409) on the way up is read again and written again; the blocked pod deleted mid-surge
    undoes the surge (abandoned: no ConsolidationFailed, nobody to tell), leaving no extra replica."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        server.scale_answers = [409]
        mover, _ = await surge_started(service, server)
        assert server.replicas == [9]  # the conflict was retried once
        gone(service, server, server.objects[PODS]["ns/big"])
        await pump(service, lambda: len(surge_writes(server)) == 4)
        assert surge_writes(server) == [("scale", 9), ("scale", 9), ("cost", "tenants-new"), ("scale", 8)]
        assert server.replicas == [9, 8]
        await service.defrag.migrator.drain()
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "abandoned"}) == 1
        assert not events(server, "ConsolidationFailed") and evictions(server) == []
        assert service.state.pods[mover["metadata"]["uid"]].evicting_for is None

    asyncio.run(with_service(test, surge_timeout_s=30.0))


def test_a_deployment_an_hpa_scales_is_not_surged_nor_evicted() -> None:
    """An HPA owns spec.replicas: no scale write (the two never fight), no eviction (the annotation rules
    out a capacity dip); the big pod and the tenant are told why, the tenants' ReplicaSet is not planned
    again within the cooldown, and the move does not count on the budget."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.defrag.migrator.surger.poll_s = 0.02
        seed(service, server)
        surge_deployment(server)
        server.put(HPAS, {"metadata": {"name": "tenants-hpa", "namespace": "ns"},
                          "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tenants"},
                                   "minReplicas": 1, "maxReplicas": 8}})
        add(service, server, pod_obj("big", units=35))

        def told_it_waits() -> bool:  # tried again after the refusal: nothing else may move for it
            return any("moving" not in e["message"] for e in events(server, "FailedScheduling"))
        await run_queue(service, rounds=60, until=told_it_waits)
        assert told_it_waits()
        assert surge_writes(server) == [] and evictions(server) == []
        failed = events(server, "ConsolidationFailed")
        assert len(failed) == 1 and "HorizontalPodAutoscaler ns/tenants-hpa" in failed[0]["message"]
        assert len(events(server, "NotMoved")) == 1
        assert set(service.defrag.movers.refused) == {"ReplicaSet/ns/tenants"}
        assert service.defrag.movers.budget_left() == service.defrag.movers.budget()
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "refused"}) == 1
        assert not service.state.reservations and not service.state.nominations

    asyncio.run(with_service(test))


def test_a_count_changed_by_someone_else_mid_surge_is_left_alone() -> None:
    """Someone scales the Deployment to 12 while the surge waits: the scheduler never writes the count
    again (it is theirs now); the migration stops and says why."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        mover, _ = await surge_started(service, server)
        theirs = copy.deepcopy(server.objects[DEPLOYMENTS]["ns/tenants"])
        theirs["spec"]["replicas"] = 12
        server.put(DEPLOYMENTS, theirs)
        ready(service, server, "tenants-new")
        await pump(service, lambda: bool(events(server, "ConsolidationFailed")))
        await service.defrag.migrator.drain()
        assert surge_writes(server) == [("scale", 9), ("cost", mover["metadata"]["name"])]
        assert server.objects[DEPLOYMENTS]["ns/tenants"]["spec"]["replicas"] == 12
        assert "is 12, not 9: changed by someone else" in events(server, "ConsolidationFailed")[0]["message"]
        value = service.metrics.registry.get_sample_value
        assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "failed"}) == 1

    asyncio.run(with_service(test, surge_timeout_s=30.0))


def test_a_surge_extends_the_recorded_holds_and_a_standby_keeps_them_that_long() -> None:
    """A surge holds the destination and the nomination for --defrag-surge-timeout more (the new replica
    must become Ready first): the migration record on the blocked pod says so too, and a standby that reads
    it holds as long, so that a failover mid-surge does not drop the holds early. (Before, the record kept
    the eviction's `until`, about 210 s: the first assertion failed.)"""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        mover, _ = await surge_started(service, server)
        big = server.objects[PODS]["ns/big"]
        try:
            record = migration_record.record_of(big)
            assert record is not None and record.until >= time.time() + 550, record
            standby = SchedulerService(SchedulerConfig(defrag=DefragConfig(after_s=0.0, min_runtime_s=0.0)),
                                       service.api)
            for name in ("n1", "n2"):
                standby.on_node("ADDED", server.objects[NODES][f"/{name}"])
            for obj in list(server.objects[PODS].values()):
                if obj["metadata"]["name"] != "big":
                    standby.on_pod("ADDED", obj)
            standby.on_pod("ADDED", recorded(server, big, mover["spec"]["nodeName"]))
            nomination = standby.state.nominations[big["metadata"]["uid"]]
            assert nomination.deadline >= standby.state.clock() + 550
            await standby.informers.stop()
        finally:
            gone(service, server, big)  # ends the surge (rolled back): nothing left waiting
            await service.defrag.migrator.drain()

    asyncio.run(with_service(test, surge_timeout_s=600.0))



# ---- a surge left unfinished by a leader that died (gpupool.io/surge on the Deployment) -------------------
def now() -> str:
    """A startTime of now (the kubelet's), in the API's format."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))


async def leader_dies_mid_surge(service: SchedulerService, server: ApiServer) -> tuple[
        dict[str, Any], dict[str, Any], SchedulerService]:
    """The seed case with a surge Deployment up to the new replica placed; then the leader dies (its tasks
    end without a word) and a new one starts from the API's objects. Returns (the mover, the new replica,
    the new leader). The Deployment is at 9 and its ReplicaSet says why."""
    mover, new = await surge_started(service, server)
    rs = server.objects[REPLICA_SETS]["ns/tenants"]
    record = SurgeRecord.decode(rs["metadata"]["annotations"][SURGE_RECORD])
    assert (record.replicas, record.mover, record.blocked) == (8, mover["metadata"]["uid"],
                                                               server.objects[PODS]["ns/big"]["metadata"]["uid"])
    assert rs["metadata"]["labels"][SURGING] == "true"
    assert server.objects[DEPLOYMENTS]["ns/tenants"]["spec"]["replicas"] == 9
    for task in list(service.defrag.migrator._tasks):
        task.cancel()
    await asyncio.gather(*service.defrag.migrator._tasks, return_exceptions=True)
    leader = restarted(server, service.api)
    leader.recorder.start()
    big = server.objects[PODS]["ns/big"]
    leader.on_pod("MODIFIED", recorded(server, big, mover["spec"]["nodeName"]))
    return mover, new, leader


def test_a_new_leader_finishes_a_surge_whose_new_replica_is_ready() -> None:
    """The new replica became Ready while no leader ran: the new leader gives the mover the lowest deletion
    cost and scales back to 8, then removes the record. (Before, nothing recorded the surge: the Deployment
    stayed at 9 for ever; the first assertion of `leader_dies_mid_surge` failed.)"""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        mover, _, leader = await leader_dies_mid_surge(service, server)
        try:
            ready(leader, server, "tenants-new", now())
            leader.defrag.lead(True)
            await leader.defrag.migrator.drain()
            assert surge_writes(server) == [("scale", 9), ("cost", mover["metadata"]["name"]), ("scale", 8)]
            assert server.objects[DEPLOYMENTS]["ns/tenants"]["spec"]["replicas"] == 8
            rs = server.objects[REPLICA_SETS]["ns/tenants"]
            assert SURGE_RECORD not in rs["metadata"]["annotations"] and SURGING not in rs["metadata"]["labels"]
            value = leader.metrics.registry.get_sample_value
            assert value("gpupool_scheduler_migrations_total", {"reason": "blocked", "result": "surged"}) == 1
            # the ReplicaSet removes the mover: the big pod takes its room on the new leader
            gone(leader, server, mover)
            await pump(leader, lambda: "ns/big" in dict(server.bindings))
            assert dict(server.bindings)["ns/big"] == mover["spec"]["nodeName"]
        finally:
            await leader.recorder.stop()
            await leader.informers.stop()

    asyncio.run(with_service(test, surge_timeout_s=30.0))


def test_a_new_leader_waits_then_rolls_back_a_surge_whose_new_replica_is_not_ready() -> None:
    """Before the recorded deadline the new leader waits (nothing written); past it, it rolls back: the new
    replica's deletion cost, the count back to 8, the record gone, the Deployment not surged again within
    the cooldown."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        _, _, leader = await leader_dies_mid_surge(service, server)
        try:
            leader.defrag.lead(True)
            await leader.defrag.migrator.drain()
            assert surge_writes(server) == [("scale", 9)]
            assert leader.defrag.surges_at is not None and leader.defrag.surges_at <= leader.queue.clock() + 2.5
            rs = copy.deepcopy(server.objects[REPLICA_SETS]["ns/tenants"])
            record = SurgeRecord.decode(rs["metadata"]["annotations"][SURGE_RECORD])
            rs["metadata"]["annotations"][SURGE_RECORD] = dataclasses.replace(
                record, until=time.time() - 1).encode()  # its deadline passed
            server.put(REPLICA_SETS, rs)
            leader.defrag.surges_at = None
            leader.defrag.lead(True)
            await leader.defrag.migrator.drain()
            assert surge_writes(server) == [("scale", 9), ("cost", "tenants-new"), ("scale", 8)]
            assert SURGE_RECORD not in server.objects[REPLICA_SETS]["ns/tenants"]["metadata"]["annotations"]
            assert set(leader.defrag.movers.refused) == {"ReplicaSet/ns/tenants"}
        finally:
            await leader.recorder.stop()
            await leader.informers.stop()

    asyncio.run(with_service(test, surge_timeout_s=30.0))


def test_a_new_leader_leaves_a_count_someone_else_changed_mid_surge() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        _, _, leader = await leader_dies_mid_surge(service, server)
        try:
            theirs = copy.deepcopy(server.objects[DEPLOYMENTS]["ns/tenants"])
            theirs["spec"]["replicas"] = 12
            server.put(DEPLOYMENTS, theirs)
            ready(leader, server, "tenants-new", now())
            leader.defrag.lead(True)
            await leader.defrag.migrator.drain()
            assert surge_writes(server) == [("scale", 9)]
            assert server.objects[DEPLOYMENTS]["ns/tenants"]["spec"]["replicas"] == 12
            assert SURGE_RECORD not in server.objects[REPLICA_SETS]["ns/tenants"]["metadata"]["annotations"]
        finally:
            await leader.recorder.stop()
            await leader.informers.stop()

    asyncio.run(with_service(test, surge_timeout_s=30.0))
