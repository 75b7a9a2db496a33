"""Elastic inference through the real service over the HTTP stand-in API server (issue 20 §3): lending
replicas on free GPUs, giving the borrowed ones back cheapest first for a waiting pod (deletion cost +
scale-down, never the Eviction API, never below min), the no-flap window at its default, the HPA contract,
borrowed replicas that never preempt, bad annotations told by an Event. The same on the real control
plane with kube-controller-manager: tests/e2e/test_elastic.py."""

from __future__ import annotations

import asyncio
from typing import Any

from gpupool_sched.framework.plugins.elastic import DEFAULT_NO_FLAP_S
from gpupool_sched.scheduler.elastic import UNPLACED_S
from gpupool_sched.scheduler.service import SchedulerService
from tests.support.apiserver import NODES, ApiServer
from tests.support.defrag_service import add, events, evictions, run_queue, with_service
from tests.support.elastic_service import (
    deletion_costs,
    deployment_obj,
    gone,
    put_autoscaler,
    put_deployment,
    replica,
    scale_writes,
)
from tests.support.objects import node_obj, pod_obj

DEPLOYMENTS_WRITTEN = "/apis/apps/v1/namespaces/ns/deployments/llm"


def nodes(service: SchedulerService, server: ApiServer, *names: str) -> None:
    for name in names:
        service.on_node("ADDED", server.put(NODES, node_obj(name)))


def start(i: int) -> str:
    return f"2026-11-30T10:{i:02d}:00Z"


async def tick(service: SchedulerService) -> None:
    service.elastic.tick(True, lambda: False)
    await service.elastic.writer.drain()
    await service.recorder.flush()


def metric(service: SchedulerService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_replica_is_lent_while_one_fits_on_free_gpus_and_not_beyond_max() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1")  # 4 GPUs
        put_deployment(service, server, deployment_obj(replicas=2, maximum=3))
        for i in range(2):
            add(service, server, replica(service, "n1", i, started=start(i)))
        await tick(service)
        assert scale_writes(server) == [("llm", 3)]
        assert next(e["message"] for e in events(server, "ElasticScaledUp")).startswith("Lent one borrowed replica")
        assert metric(service, "gpupool_scheduler_elastic_scaled_total", direction="up") == 1
        # the Deployment now asks 3, one pending: nothing more until it runs
        put_deployment(service, server, deployment_obj(replicas=3, maximum=3))
        await tick(service)
        assert scale_writes(server) == [("llm", 3)]
        add(service, server, replica(service, "n1", 2, started=start(2)))
        await tick(service)
        assert scale_writes(server) == [("llm", 3)], "at max: no more"
        assert metric(service, "gpupool_scheduler_elastic_replicas", namespace="ns", deployment="llm",
                      tier="borrowed") == 1
        assert metric(service, "gpupool_scheduler_elastic_replicas", namespace="ns", deployment="llm",
                      tier="guaranteed") == 2

    asyncio.run(with_service(test))


def test_nothing_is_lent_without_free_room_or_demand() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1")
        put_deployment(service, server, deployment_obj(replicas=4, minimum=2, maximum=6))
        for i in range(4):
            add(service, server, replica(service, "n1", i, started=start(i)))
        await tick(service)
        assert scale_writes(server) == [], "no free GPU: nothing lent"
        put_deployment(service, server, deployment_obj(replicas=4, minimum=2, maximum=4))
        put_deployment(service, server, deployment_obj(
            name="q", replicas=1, minimum=1, maximum=6, **{
                "gpupool.io/elastic-demand": "queue-length", "gpupool.io/elastic-target-per-replica": "10",
                "gpupool.io/elastic-queue-length": "5"}))
        nodes(service, server, "n2")
        add(service, server, replica(service, "n2", 0, deployment="q", started=start(0)))
        await tick(service)
        assert scale_writes(server) == [], "a queue of 5 at 10 per replica needs 1 replica"

    asyncio.run(with_service(test))


def six_replicas(service: SchedulerService, server: ApiServer, **inflight: int) -> list[dict[str, Any]]:
    """min 2, max 6 on n1 (4 GPUs) and n2 (2 of 4): the two oldest on n1 are guaranteed."""
    nodes(service, server, "n1", "n2")
    put_deployment(service, server, deployment_obj(replicas=6))
    where = [("n1", 0), ("n1", 1), ("n1", 2), ("n1", 3), ("n2", 0), ("n2", 1)]
    return [add(service, server, replica(service, node, gpu, started=start(i), inflight=inflight.get(str(i))))
            for i, (node, gpu) in enumerate(where)]


def test_a_waiting_pod_gets_borrowed_gpus_back_by_scale_down_and_is_bound_on_them() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        pods = six_replicas(service, server)
        train = add(service, server, pod_obj("train", gpus=4))
        await run_queue(service, rounds=3)
        await service.elastic.writer.drain()
        await service.recorder.flush()
        # n2's two borrowed replicas make 4 GPUs with its 2 free: the fewest to give back
        names = [p["metadata"]["name"] for p in pods]
        assert sorted(deletion_costs(server)) == sorted(names[4:6])
        assert scale_writes(server) == [("llm", 4)]
        assert evictions(server) == [], "a loan is never evicted (its ReplicaSet would recreate it)"
        gave = events(server, "ElasticGaveBack")
        assert len(gave) == 1 and "for ns/train" in gave[0]["message"]
        assert gave[0]["involvedObject"]["kind"] == "Deployment"
        assert service.state.nominations[train["metadata"]["uid"]].node == "n2"
        assert metric(service, "gpupool_scheduler_elastic_scaled_total", direction="down") == 2
        for pod in pods[4:6]:  # the ReplicaSet removes the two lowest-cost replicas
            gone(service, server, pod)
        await run_queue(service, rounds=40, until=lambda: any(k == "ns/train" for k, _ in server.bindings))
        assert ("ns/train", "n2") in server.bindings
        assert metric(service, "gpupool_scheduler_elastic_handover_seconds_count") == 1

    asyncio.run(with_service(test))


def test_the_cheapest_borrowed_replica_goes_first_fewest_in_flight_then_youngest() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        # borrowed: 2, 3 (n1), 4, 5 (n2); 5 is the youngest but busy, 4 has one in flight
        pods = six_replicas(service, server, **{"5": 9, "4": 1, "2": 0, "3": 0})
        other = add(service, server, pod_obj("other", gpus=2, node="n2", phase="Running"))
        del other
        add(service, server, pod_obj("small", gpus=1))
        await run_queue(service, rounds=3)
        await service.elastic.writer.drain()
        assert deletion_costs(server) == [pods[3]["metadata"]["name"]], "idle and youngest of the idle"
        assert scale_writes(server) == [("llm", 5)]

    asyncio.run(with_service(test))


def test_min_replicas_are_never_given_back() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        six_replicas(service, server)
        add(service, server, pod_obj("huge", gpus=4))  # one node's 4 GPUs: n1 holds both guaranteed
        add(service, server, pod_obj("huge2", gpus=4))
        await run_queue(service, rounds=4)
        await service.elastic.writer.drain()
        # huge takes n2 (2 borrowed back); huge2 would need n1, where the guaranteed two run: nothing more
        assert len(deletion_costs(server)) == 2
        assert [r for _, r in scale_writes(server)] == [4]
        assert evictions(server) == []

    asyncio.run(with_service(test))


def test_no_replica_is_lent_again_within_the_default_no_flap_window() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        now = [1000.0]
        service.queue.clock = lambda: now[0]
        assert service.elastic.flap.window_s == DEFAULT_NO_FLAP_S == 300.0
        pods = six_replicas(service, server)
        train = add(service, server, pod_obj("train", gpus=4))
        await run_queue(service, rounds=2)
        await service.elastic.writer.drain()
        for pod in pods[4:6]:
            gone(service, server, pod)
        put_deployment(service, server, deployment_obj(replicas=4))
        await run_queue(service, rounds=3)
        gone(service, server, train)  # the training ends: n2 is free again
        now[0] += DEFAULT_NO_FLAP_S - 1
        await tick(service)
        assert scale_writes(server) == [("llm", 4)], "within 5 min of the give-back: nothing lent"
        now[0] += 1
        await tick(service)
        assert scale_writes(server) == [("llm", 4), ("llm", 5)]

    asyncio.run(with_service(test))


def test_with_an_hpa_only_its_max_replicas_is_lent_and_lowered() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1", "n2")
        put_deployment(service, server, deployment_obj(replicas=2))
        hpa = put_autoscaler(service, server, "llm", max_replicas=2)
        pods = [add(service, server, replica(service, "n2", i, started=start(i))) for i in range(2)]
        await tick(service)
        assert scale_writes(server) == [], "an HPA owns the count: gpupool never raises it"
        patched = server.objects["/apis/autoscaling/v2/horizontalpodautoscalers"]["ns/llm-hpa"]
        assert patched["spec"]["maxReplicas"] == 3
        service.elastic.on_autoscaler("MODIFIED", patched)
        await tick(service)
        assert patched["spec"]["maxReplicas"] == 3, "the HPA does not use what it was lent: no more"
        # the HPA scaled to 3 and 4 (n2 full); a pod needs n2's 4 GPUs... not possible (2 guaranteed there):
        # it needs 2: the HPA's max goes down with the count
        put_deployment(service, server, deployment_obj(replicas=4))
        pods += [add(service, server, replica(service, "n2", i, started=start(i))) for i in range(2, 4)]
        service.elastic.hpa_max["ns/llm"] = 4
        nodes(service, server)
        for i in range(4):
            add(service, server, pod_obj(f"fill-{i}", gpus=1, node="n1", phase="Running"))
        add(service, server, pod_obj("two", gpus=2))
        await run_queue(service, rounds=3)
        await service.elastic.writer.drain()
        hpa_now = server.objects["/apis/autoscaling/v2/horizontalpodautoscalers"]["ns/llm-hpa"]
        assert hpa_now["spec"]["maxReplicas"] == 2
        assert scale_writes(server)[-1] == ("llm", 2)
        del hpa

    asyncio.run(with_service(test))


def test_a_borrowed_replica_never_preempts_or_takes_anything_back() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1")
        put_deployment(service, server, deployment_obj(replicas=3))
        for i in range(2):
            add(service, server, replica(service, "n1", i, started=start(i)))
        for i in range(2):
            add(service, server, pod_obj(f"low-{i}", gpus=1, node="n1", phase="Running"))
        pending = replica(service, "n1", 0, started=start(5))
        pending["spec"].pop("nodeName")
        pending["metadata"]["annotations"] = {}
        pending["spec"]["priority"] = 1000
        add(service, server, pending)
        await run_queue(service, rounds=3)
        assert evictions(server) == [] and scale_writes(server) == []
        assert not service.state.nominations

    asyncio.run(with_service(test))


def test_bad_annotations_are_told_on_the_deployment_once_and_it_is_left_alone() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1")
        bad = deployment_obj(replicas=1, minimum=3, maximum=2)
        put_deployment(service, server, bad)
        put_deployment(service, server, bad)
        add(service, server, replica(service, "n1", 0, started=start(0)))
        await tick(service)
        told = events(server, "ElasticInvalid")
        assert len(told) == 1
        assert "gpupool.io/elastic-max: 2 is below gpupool.io/elastic-min (3)" in told[0]["message"]
        assert scale_writes(server) == []

    asyncio.run(with_service(test))


def test_a_lent_replica_that_finds_no_free_gpu_is_taken_back_after_a_minute() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        now = [1000.0]
        service.queue.clock = lambda: now[0]
        nodes(service, server, "n1")
        put_deployment(service, server, deployment_obj(replicas=3))  # lent one; its GPU was taken meanwhile
        for i in range(2):
            add(service, server, replica(service, "n1", i, started=start(i)))
        for i in range(2):
            add(service, server, pod_obj(f"took-{i}", gpus=1, node="n1", phase="Running"))
        pending = replica(service, "n1", 0, started=start(5))
        pending["spec"].pop("nodeName")
        pending["metadata"]["annotations"] = {}
        add(service, server, pending)
        await run_queue(service, rounds=2)
        assert service._waiting_for_gpus(), "the lent replica waits in the queue"

        async def tick_waiting() -> None:
            service.elastic.tick(True, service._waiting_for_gpus)
            await service.elastic.writer.drain()
            await service.recorder.flush()

        await tick_waiting()
        now[0] += UNPLACED_S - 1
        await tick_waiting()
        assert scale_writes(server) == []
        now[0] += 1
        await tick_waiting()
        assert scale_writes(server) == [("llm", 2)]
        assert "found no free GPU" in events(server, "ElasticGaveBack")[0]["message"]
        assert not service.elastic.flap.may_grow("ns/llm", now[0]), "a give-back for the no-flap window"

    asyncio.run(with_service(test))


def test_a_deleted_deployment_leaves_no_tier_series() -> None:
    async def test(service: SchedulerService, server: ApiServer) -> None:
        nodes(service, server, "n1")
        stored = put_deployment(service, server, deployment_obj(replicas=2))
        for i in range(2):
            add(service, server, replica(service, "n1", i, started=start(i)))
        await tick(service)
        assert metric(service, "gpupool_scheduler_elastic_replicas", namespace="ns", deployment="llm",
                      tier="guaranteed") == 2
        service.elastic.on_deployment("DELETED", stored)
        labels = {"namespace": "ns", "deployment": "llm", "tier": "guaranteed"}
        assert service.metrics.registry.get_sample_value("gpupool_scheduler_elastic_replicas", labels) is None

    asyncio.run(with_service(test))


def test_the_handover_is_measured_when_the_binding_answer_is_lost_but_it_landed() -> None:
    """The waiting pod's Binding commits but its answer is lost: the read (or the watch) that settles it
    ends the handover too, or the histogram misses the handovers of a busy API server."""
    async def test(service: SchedulerService, server: ApiServer) -> None:
        pods = six_replicas(service, server)
        add(service, server, pod_obj("train", gpus=4))
        await run_queue(service, rounds=3)
        await service.elastic.writer.drain()
        for pod in pods[4:6]:
            gone(service, server, pod)
        server.answer = "lost"
        await run_queue(service, rounds=40, until=lambda: any(k == "ns/train" for k, _ in server.bindings))
        for _ in range(50):
            if metric(service, "gpupool_scheduler_elastic_handover_seconds_count"):
                break
            await asyncio.sleep(0.1)
        assert ("ns/train", "n2") in server.bindings
        assert metric(service, "gpupool_scheduler_bind_verified_total", outcome="bound") == 1
        assert metric(service, "gpupool_scheduler_elastic_handover_seconds_count") == 1

    asyncio.run(with_service(test))
