"""A nomination displaced by a more important pod is cleared in the API, as kube-scheduler clears the
nominatedNodeName of lower-priority pods nominated to the node it nominates a preemptor to
(preemption's prepareCandidate): the room the lower pod waited for went to the other pod, and its status
must not go on saying it will run there (`gpupool status`, a standby's adoption and people read it).
Through the real service over the HTTP stand-in API server."""

from __future__ import annotations

import asyncio
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.scheduler.service import SchedulerService
from tests.support.apiserver import NODES, PODS, ApiServer
from tests.support.defrag_service import run_queue, with_service
from tests.support.objects import node_obj, pod_obj


def nominations(server: ApiServer) -> list[tuple[str, str | None]]:
    """(pod, node) of every nominatedNodeName write, in order (None: cleared)."""
    return [(path.split("/")[-2], body["status"]["nominatedNodeName"]) for method, path, body in server.written
            if method == "PATCH" and path.endswith("/status") and "nominatedNodeName" in body.get("status", {})]


def running(service: SchedulerService, server: ApiServer, name: str, priority: int, gpus: range) -> None:
    obj = pod_obj(name, gpus=len(gpus), node="n1", phase="Running", scheduler="other")
    obj["spec"]["priority"] = priority
    uuids = tuple(service.state.nodes["n1"].spec.gpus[g].uuid for g in gpus)
    ack = AllocationAck(node="n1", pod_uid=obj["metadata"]["uid"], complete=True,
                        containers={"main": {"nvidia.com/gpu": uuids}})
    obj["metadata"]["annotations"].update(ack_annotations(ack))
    service.on_pod("ADDED", server.put(PODS, obj))


def pending(service: SchedulerService, server: ApiServer, name: str, priority: int, gpus: int) -> dict[str, Any]:
    obj = pod_obj(name, gpus=gpus)
    obj["spec"]["priority"] = priority
    stored = server.put(PODS, obj)
    service.on_pod("ADDED", stored)
    return stored


def test_a_lower_nomination_whose_room_a_more_important_preemptor_takes_is_cleared_in_the_api() -> None:
    """n1 (8 GPUs): p (priority 100) on GPUs 0-1, q (300) on 2-3, 4-7 free. mid (500, 6 GPUs) preempts p
    and is nominated to n1, holding 4-7; crit (1000, 6 GPUs) preempts q and takes 4-7 from mid: mid's
    nominatedNodeName is cleared, crit's stays."""

    async def test(service: SchedulerService, server: ApiServer) -> None:
        service.on_node("ADDED", server.put(NODES, node_obj("n1", "dgx-h100")))
        running(service, server, "p", 100, range(0, 2))
        running(service, server, "q", 300, range(2, 4))
        pending(service, server, "mid", 500, 6)
        await run_queue(service, rounds=1)
        await service.preemptor.drain()
        assert nominations(server) == [("mid", "n1")]
        pending(service, server, "crit", 1000, 6)
        await run_queue(service, rounds=1)
        await service.preemptor.drain()
        first, *then = nominations(server)
        assert first == ("mid", "n1") and sorted(then, key=str) == [("crit", "n1"), ("mid", None)]
        mid_uid = next(uid for uid, e in service.state.nominations.items() if e.key.endswith("/mid"))
        assert service.state.nominations[mid_uid].holds == set()  # its room is crit's now

    asyncio.run(with_service(test, enabled=False))
