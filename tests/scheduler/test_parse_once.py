"""A pod is parsed once per version of its spec, not once per look (issue 18, "parse once").

`plan_pod` (containers, requests, constraints, priority) is what turns the API server's JSON into what
placement uses. Before `PodInfo`, the scheduler ran it again on every pop of a pending pod, on every
status event of a bound pod with an ack, and the extender on each of filter, prioritize and bind of the
same pod. The counts below are the calls for one pod's life; on the old code they were 3, 4 and 4."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

import gpupool_sched.kube.podspec as podspec
from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.cache.entries import Phase
from gpupool_sched.extender.core import Extender, ExtenderConfig
from gpupool_sched.extender.protocol import ExtenderArgs
from gpupool_sched.framework.queue import QueuedPod
from gpupool_sched.kube.kubeapi import KubeApi
from gpupool_sched.scheduler.service import PDBS, PRIORITY_CLASSES, SchedulerConfig, SchedulerService
from tests.support.apiserver import serving
from tests.support.objects import bump, node_obj, pod_obj


async def with_service(test: Callable[[SchedulerService], Awaitable[None]]) -> None:
    """The real service over the HTTP stand-in API server (nothing is listed: the test feeds the events)."""
    async with serving() as (server, api):
        for path in (PDBS, PRIORITY_CLASSES, "/api/v1/namespaces"):
            server.objects[path] = {}
        service = SchedulerService(SchedulerConfig(), api)
        try:
            await test(service)
        finally:
            await service.informers.stop()
            await service.binder.drain()


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every `plan_pod` call, by pod name, wherever the function was imported."""
    calls: list[str] = []
    original = podspec.plan_pod

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str((obj.get("metadata") or {}).get("name")))
        return original(obj, *args, **kwargs)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("gpupool_sched") and \
                getattr(module, "plan_pod", None) is original:
            monkeypatch.setattr(module, "plan_pod", counting)
    yield calls


def test_a_pending_pod_popped_again_after_a_status_update_is_not_parsed_again(parses: list[str]) -> None:
    async def test(service: SchedulerService) -> None:
        service.on_node("ADDED", node_obj("n1"))  # 8 GPUs: a 16-GPU pod fits nowhere
        pod = pod_obj("big", gpus=16)
        uid = pod["metadata"]["uid"]
        item = QueuedPod(uid=uid, key="ns/big", priority=0, created=0.0)
        service.on_pod("ADDED", pod)
        service.schedule_one(item)
        # the scheduler's own Unschedulable condition comes back: status only, spec unchanged
        updated = bump(pod)
        updated["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                            "reason": "Unschedulable", "message": "no"}]
        service.on_pod("MODIFIED", updated)
        service.schedule_one(item)
        service.on_node("ADDED", node_obj("n2"))  # same facts (models, profiles): plans still hold
        service.schedule_one(item)
        assert uid not in service.state.pods
        assert parses.count("big") == 1, parses

    asyncio.run(with_service(test))


def test_a_changed_spec_or_new_gpu_model_is_parsed_again(parses: list[str]) -> None:
    """The memo never hides a change: a new spec, or a cluster whose models changed, plans again."""

    async def test(service: SchedulerService) -> None:
        service.on_node("ADDED", node_obj("n1"))
        pod = pod_obj("m", gpus=1, annotations={"gpupool.io/gpu-model": "H100"})
        uid = pod["metadata"]["uid"]
        item = QueuedPod(uid=uid, key="ns/m", priority=0, created=0.0)
        service.on_pod("ADDED", pod)
        service.schedule_one(item)  # unknown model: not yet schedulable
        assert uid not in service.state.pods and parses.count("m") == 1
        service.on_node("ADDED", node_obj("n2", "dgx-h100"))  # H100 joins: planned again, placed
        service.schedule_one(item)
        assert parses.count("m") == 2
        assert service.state.pods[uid].node == "n2"

    asyncio.run(with_service(test))


def test_a_bound_pods_status_events_do_not_parse_it_again(parses: list[str]) -> None:
    async def test(service: SchedulerService) -> None:
        service.on_node("ADDED", node_obj("n1"))
        gpu = service.state.nodes["n1"].spec.gpus[2].uuid
        pod = pod_obj("other", gpus=1, node="n1", scheduler="default-scheduler")
        uid = pod["metadata"]["uid"]
        ack = AllocationAck(node="n1", pod_uid=uid, containers={"main": {"nvidia.com/gpu": (gpu,)}},
                            complete=True)
        pod = bump(pod, annotations=ack_annotations(ack))
        service.on_pod("ADDED", pod)
        for phase in ("Pending", "Running", "Running"):  # the kubelet's status updates
            pod = bump(pod, phase=phase)
            service.on_pod("MODIFIED", pod)
        entry = service.state.pods[uid]
        assert entry.phase is Phase.CONFIRMED
        assert [g for part in entry.placement.parts() for g in part.gpu_indices] == [2]
        assert parses.count("other") == 1, parses

    asyncio.run(with_service(test))


def test_the_extenders_filter_and_prioritize_of_one_pod_parse_it_once(parses: list[str]) -> None:
    extender = Extender(ExtenderConfig(), KubeApi(client.ApiClient(client.Configuration())))
    extender.synced.set()
    extender.on_node("ADDED", node_obj("n1"))
    pod = pod_obj("x", gpus=1, scheduler="default-scheduler")
    extender.on_pod("ADDED", pod)  # kube-scheduler's pods are pending on the extender's watch too
    args = ExtenderArgs(pod=pod, node_names=["n1"])
    assert extender.filter(args)["NodeNames"] == ["n1"]
    assert extender.prioritize(args)[0]["Score"] > 0
    assert extender.filter(args)["NodeNames"] == ["n1"]  # kube-scheduler asks again on its next attempt
    assert parses.count("x") == 1, parses


def test_a_pending_pods_object_is_let_go_once_the_watch_shows_it_bound() -> None:
    """The pending pod's parsed object is kept for its decisions only: once the API server shows it bound
    it is dropped, not kept until the pod is deleted (a parsed object per running pod; a guard, it held
    before this test too)."""
    async def test(service: SchedulerService) -> None:
        service.on_node("ADDED", node_obj("n1"))
        pod = pod_obj("p", gpus=1)
        uid = pod["metadata"]["uid"]
        service.on_pod("ADDED", pod)
        service.schedule_one(QueuedPod(uid=uid, key="ns/p", priority=0, created=0.0))
        assert uid in service.state.pods and uid in service.pending  # assumed: the watch has not shown it yet
        bound = bump(pod)
        bound["spec"]["nodeName"] = service.state.pods[uid].node
        service.on_pod("MODIFIED", bound)
        assert uid in service.state.pods and uid not in service.pending

    asyncio.run(with_service(test))
