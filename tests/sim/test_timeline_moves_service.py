"""The time simulator moves pods as the scheduler service does: one fragmented scenario (a pod that fits only
after a move) driven once through the real `SchedulerService` over the stand-in API server (pods owned by
ReplicaSets, bindings confirmed by the watch, departures and the mover's eviction as watch deletions, the
ReplicaSet's replacement as a new pod) and once through `Timeline` with `--defrag on`: the same mover, the
same destination (node and GPUs), the blocked pod on the same node and GPUs, the replacement on its
reserved room. (A bound pod holds GPUs for the movers' plugin once the device plugin's answer says which:
the watch's confirmation carries it, as tests/support/defrag_service.tenant does.)"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.reservations import reservation_uid
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.scheduler.service import SchedulerService
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.timeline import Decision, Timeline
from tests.support.apiserver import NODES, PODS, ApiServer
from tests.support.defrag_service import add, evictions, owned, run_queue, with_service
from tests.support.objects import bump, node_obj, pod_obj

# name, arrival, GPUs, lifetime; two 4-GPU nodes (l40s), best-fit: h fits only once b or d moves
SCENARIO = [("a", 0.0, 3, 1000.0), ("b", 1.0, 1, 5000.0), ("c", 2.0, 3, 1000.0), ("d", 3.0, 1, 5000.0),
            ("h", 2000.0, 4, 300.0)]
GPU = "nvidia.com/gpu"
DEFRAG = {"after_s": 0.0, "min_runtime_s": 0.0}  # what tests/support/defrag_service.with_service runs


def service_story() -> dict[str, Any]:
    """What the service decides: the mover, its destination, where the blocked pod and the replacement go."""
    out: dict[str, Any] = {}

    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        objs: dict[str, dict[str, Any]] = {}

        async def place(name: str, obj: dict[str, Any]) -> None:
            objs[name] = add(service, server, obj)
            await run_queue(service, rounds=10, until=lambda: f"ns/{obj['metadata']['name']}" in dict(server.bindings))
            node = dict(server.bindings)[f"ns/{obj['metadata']['name']}"]
            uid = obj["metadata"]["uid"]
            gpus = service.state.pods[uid].placement.gpu_indices
            uuids = tuple(service.state.nodes[node].spec.gpus[j].uuid for j in gpus)
            ack = AllocationAck(node=node, pod_uid=uid, complete=True, containers={"main": {GPU: uuids}})
            # the watch confirms the binding, with the device plugin's answer (which GPUs)
            objs[name] = bump(objs[name], node=node, phase="Running", annotations=ack_annotations(ack))
            objs[name]["metadata"]["resourceVersion"] = server.version()  # newer than what the service saw
            service.on_pod("MODIFIED", objs[name])

        def gone(name: str) -> None:
            server.delete(PODS, objs[name])
            obj = copy.deepcopy(objs.pop(name))
            obj["metadata"]["resourceVersion"] = server.version()
            service.on_pod("DELETED", obj)

        for name, _, gpus, _ in SCENARIO[:4]:
            await place(name, owned(pod_obj(name, gpus=gpus), owner=name))
        out["filled"] = {n: (o["spec"]["nodeName"], service.state.pods[o["metadata"]["uid"]].placement.gpu_indices)
                         for n, o in objs.items()}
        gone("a")
        gone("c")
        h = add(service, server, owned(pod_obj("h", gpus=4), owner="h"))
        await run_queue(service, rounds=5, until=lambda: bool(evictions(server)))
        [mover] = evictions(server)
        reservation = service.state.reservations[reservation_uid(objs[mover]["metadata"]["uid"])]
        out["moved"] = (mover, reservation.destination.node, reservation.destination.gpu_indices)
        out["nominated"] = service.state.nominations[h["metadata"]["uid"]].node
        gone(mover)  # the kubelet stops it; its ReplicaSet makes a replacement
        replacement = add(service, server, owned(pod_obj(f"{mover}-new", gpus=1), owner=mover))
        await run_queue(service, rounds=30, until=lambda: {"ns/h", f"ns/{mover}-new"} <= set(dict(server.bindings)))
        for key, obj in (("h", h), ("replacement", replacement)):
            entry = service.state.pods[obj["metadata"]["uid"]]
            out[key] = (entry.node, entry.placement.gpu_indices)

    asyncio.run(with_service(test, policy="best-fit", **DEFRAG))
    return out


def test_the_timeline_moves_the_pod_the_service_moves() -> None:
    story = service_story()
    nodes = [node_obj(n) for n in ("n1", "n2")]
    state = ClusterState("gpupool")
    for obj in nodes:
        state.apply_node(obj)
    requests = {name: state.plan(owned(pod_obj(name, gpus=gpus), owner=name)).request
                for name, _, gpus, _ in SCENARIO}
    policy = build_policy("best-fit")
    timeline = Timeline([state.nodes[n] for n in ("n1", "n2")], lambda: policy, record=True,
                        defrag=DefragConfig(**DEFRAG))
    timeline.run(iter([(at, TimedPod(requests[name], life, 1e6, "p0")) for name, at, _, life in SCENARIO]), 2100.0)

    placed = {d.pod: (d.node, d.gpus) for d in timeline.decisions[:4]}
    assert placed == story["filled"]
    move, blocked, replaced = timeline.decisions[4:]
    mover, node, gpus = story["moved"]
    assert move == Decision(2000.0, "h", story["nominated"], (), moved=((mover, node, gpus),))
    assert (blocked.pod, (blocked.node, blocked.gpus)) == ("h", story["h"])
    assert (replaced.pod, (replaced.node, replaced.gpus)) == (mover, story["replacement"]) == (mover, (node, gpus))
    assert timeline.stats.migrations == 1 and timeline.stats.preemptions == 0
