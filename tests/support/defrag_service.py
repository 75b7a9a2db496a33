"""What the scheduler-level defragmentation tests share (tests/scheduler/test_defrag*.py): the real
service over the HTTP stand-in API server, running ReplicaSet tenants with the device plugin's ack, and
the writes that tell a migration's story."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.movers import JOBS
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


async def with_service(test: Callable[[SchedulerService, ApiServer], Awaitable[None]], policy: str = "gpupool",
                       **defrag: Any) -> None:
    async with serving() as (server, api):
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces", JOBS):
            server.objects[path] = {}
        config = SchedulerConfig(policy=policy,
                                 defrag=DefragConfig(**{"after_s": 0.0, "min_runtime_s": 0.0, **defrag}))
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
