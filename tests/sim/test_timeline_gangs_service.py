"""The time simulator decides a gang as the scheduler service decides a PodGroup's job: one scenario (a gang
that fits only whole after a departure, then a higher-priority gang that preempts) driven once through the
real `SchedulerService` over the stand-in API server (a PodGroup, its members labelled, bindings confirmed
by the watch with the device plugin's answer, departures and evictions as watch deletions) and once through
`Timeline` with `TimeGangs`: nothing placed while the gang cannot fit whole, then the same nodes and GPUs for
its members at the same moment, the same victims, the same room for the preempting gang."""

from __future__ import annotations

import asyncio
import copy
import datetime
import functools
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.scheduler.service import SchedulerService
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.timegangs import GangArrival, GangSpec, TimeGangs
from gpupool_sched.simulate.timeline import Timeline
from gpupool_sched.simulate.timemoves import EPOCH
from tests.support.apiserver import NODES, PODS, ApiServer
from tests.support.defrag_service import add, run_queue, with_service
from tests.support.objects import bump, node_obj, pod_obj

# two 4-GPU nodes (l40s). a and b are lone pods; g (3 x 2 GPUs) fits whole only once b leaves at 301;
# h (2 x 2 GPUs, priority 1000) arrives at 400 on a full cluster and preempts
LONE = [("a", 0.0, 2, 500.0), ("b", 1.0, 3, 300.0)]
GANGS = [("g", 2.0, 3, 2, 0, 1000.0), ("h", 400.0, 2, 2, 1000, 50.0)]  # name, arrival, size, GPUs, priority, life
GPU = "nvidia.com/gpu"
DEFRAG = {"after_s": 0.0, "min_runtime_s": 0.0}  # what tests/support/defrag_service.with_service runs
Where = tuple[str, tuple[int, ...]]


def started(at: float) -> str:
    """status.startTime of a pod started at `at` on the simulator's clock (timemoves.EPOCH at 0)."""
    return datetime.datetime.fromtimestamp(EPOCH + at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def member(gang: str, i: int, gpus: int, priority: int) -> dict[str, Any]:
    obj = pod_obj(f"{gang}-{i}", gpus=gpus)
    obj["metadata"]["labels"] = {POD_GROUP_LABEL: gang}
    obj["spec"]["priority"] = priority
    return obj


def service_story() -> dict[str, Any]:
    """Where the service places everything, and what it evicts for h."""
    out: dict[str, Any] = {}

    async def test(service: SchedulerService, server: ApiServer) -> None:
        for name in ("n1", "n2"):
            service.on_node("ADDED", server.put(NODES, node_obj(name)))
        objs: dict[str, dict[str, Any]] = {}

        def bound(name: str) -> bool:
            return f"ns/{name}" in dict(server.bindings)

        def confirm(name: str, at: float) -> Where:
            """The watch confirms the binding with the device plugin's answer and the pod's start (`at` on the
            simulator's clock, which preemption's tie-breaks read); where it went."""
            node = dict(server.bindings)[f"ns/{name}"]
            uid = objs[name]["metadata"]["uid"]
            gpus = service.state.pods[uid].placement.gpu_indices
            uuids = tuple(service.state.nodes[node].spec.gpus[j].uuid for j in gpus)
            ack = AllocationAck(node=node, pod_uid=uid, complete=True, containers={"main": {GPU: uuids}})
            objs[name] = bump(objs[name], node=node, phase="Running", annotations=ack_annotations(ack))
            objs[name]["metadata"]["resourceVersion"] = server.version()
            objs[name]["status"]["startTime"] = started(at)
            service.on_pod("MODIFIED", objs[name])
            return node, gpus

        def gone(name: str) -> None:
            server.delete(PODS, objs[name])
            obj = copy.deepcopy(objs.pop(name))
            obj["metadata"]["resourceVersion"] = server.version()
            service.on_pod("DELETED", obj)

        for name, at, gpus, _ in LONE:
            objs[name] = add(service, server, pod_obj(name, gpus=gpus))
            await run_queue(service, rounds=10, until=functools.partial(bound, name))
            out[name] = confirm(name, at)
        for gang, _, size, gpus, priority, _ in GANGS:
            service.on_pod_group("ADDED", {"metadata": {"name": gang, "namespace": "ns", "uid": f"pg-{gang}"},
                                           "spec": {"minMember": size}})
            names = [f"{gang}-{i}" for i in range(size)]
            for i, name in enumerate(names):
                objs[name] = add(service, server, member(gang, i, gpus, priority))
            if gang == "g":
                await run_queue(service, rounds=3)
                out["g_before"] = [n for n in names if bound(n)]  # it does not fit whole: nobody
                gone("b")
                await run_queue(service, rounds=10, until=lambda ns=names: all(bound(n) for n in ns))
                out["g"] = sorted(confirm(n, 301.0) for n in names)
            else:
                where = {name: (o["spec"]["nodeName"], service.state.pods[o["metadata"]["uid"]].placement.gpu_indices)
                         for name, o in objs.items() if name in ("a", "g-0", "g-1", "g-2")}
                await run_queue(service, rounds=10, until=lambda: any(p.endswith("/eviction")
                                                                       for _, p, _ in server.written))
                victims = [p.split("/")[-2] for m, p, _ in server.written if m == "POST" and p.endswith("/eviction")]
                out["victims"] = sorted(where[v] for v in victims)
                for victim in victims:
                    gone(victim)  # the kubelet stops them
                await run_queue(service, rounds=10, until=lambda ns=names: all(bound(n) for n in ns))
                out["h"] = sorted(confirm(n, 400.0) for n in names)

    asyncio.run(with_service(test, policy="best-fit", **DEFRAG))
    return out


def test_the_timeline_decides_a_gang_as_the_service() -> None:
    story = service_story()
    state = ClusterState("gpupool")
    for name in ("n1", "n2"):
        state.apply_node(node_obj(name))
    policy = build_policy("best-fit")
    timeline = Timeline([state.nodes[n] for n in ("n1", "n2")], lambda: policy, record=True,
                        defrag=DefragConfig(**DEFRAG))
    gangs = TimeGangs(timeline, GangSpec(1.0, 3))
    for gang, at, size, gpus, priority, life in GANGS:
        request = state.plan(member(gang, 0, gpus, priority)).request
        arrival = GangArrival(gang, TimedPod(request, life, 1e6, f"p{priority}"), size)
        timeline.call_at(at, functools.partial(gangs.arrive, arrival))
    lone = [(at, TimedPod(state.plan(pod_obj(name, gpus=gpus)).request, life, 1e6, "p0"))
            for name, at, gpus, life in LONE]
    timeline.run(iter(lone), 420.0)

    decisions = timeline.decisions
    placed = {d.pod: (d.node, d.gpus) for d in decisions if not d.victims}
    assert (placed["a"], placed["b"]) == (story["a"], story["b"])
    assert story["g_before"] == []
    g = [d for d in decisions if d.pod.startswith("g-")]
    assert {d.time for d in g} == {301.0}  # when b left, all at once
    assert sorted((d.node, d.gpus) for d in g) == story["g"]
    [preemption] = [d for d in decisions if d.victims]
    assert (preemption.time, preemption.pod) == (400.0, "h")
    held = {d.pod: (d.node, d.gpus) for d in decisions if not d.victims and d.time < 400.0}
    assert sorted(held[v] for v in preemption.victims) == story["victims"]
    h = [d for d in decisions if d.pod.startswith("h-") and not d.victims]
    assert {d.time for d in h} == {400.0}
    assert sorted((d.node, d.gpus) for d in h) == story["h"]
