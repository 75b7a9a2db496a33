"""What the scheduler-level elastic inference tests share (tests/scheduler/test_elastic.py): an elastic
Deployment on the HTTP stand-in API server and its running whole-GPU replicas with the plugin's ack."""

from __future__ import annotations

import itertools
from typing import Any

from gpupool_common.handshake import AllocationAck, ack_annotations
from gpupool_sched.scheduler.elastic import AUTOSCALERS, DEPLOYMENTS
from gpupool_sched.scheduler.service import SchedulerService
from tests.support.apiserver import PODS, ApiServer
from tests.support.objects import pod_obj

GPU = "nvidia.com/gpu"
HASH = "5d9f7c"
_names = itertools.count()


def deployment_obj(name: str = "llm", replicas: int = 2, minimum: int = 2, maximum: int = 6,
                   **annotations: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "ns", "uid": f"dep-{name}", "generation": 1,
                         "annotations": {"gpupool.io/elastic-min": str(minimum),
                                         "gpupool.io/elastic-max": str(maximum), **annotations}},
            "spec": {"replicas": replicas}}


def put_deployment(service: SchedulerService, server: ApiServer, obj: dict[str, Any]) -> dict[str, Any]:
    server.objects.setdefault(DEPLOYMENTS, {})
    stored = server.put(DEPLOYMENTS, obj)
    service.elastic.on_deployment("MODIFIED", stored)
    return stored


def put_autoscaler(service: SchedulerService, server: ApiServer, deployment: str, max_replicas: int,
                   min_replicas: int = 2) -> dict[str, Any]:
    server.objects.setdefault(AUTOSCALERS, {})
    stored = server.put(AUTOSCALERS, {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"{deployment}-hpa", "namespace": "ns", "uid": f"hpa-{deployment}"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
                 "minReplicas": min_replicas, "maxReplicas": max_replicas}})
    service.elastic.on_autoscaler("MODIFIED", stored)
    return stored


def replica(service: SchedulerService, node: str, gpu: int, *, deployment: str = "llm", started: str,
            inflight: int | None = None, gpus: int = 1) -> dict[str, Any]:
    """A running replica of `deployment` holding whole GPU(s) from `gpu` on `node` (the plugin's ack)."""
    obj = pod_obj(f"{deployment}-{HASH}-{next(_names)}", gpus=gpus, node=node, phase="Running")
    obj["metadata"]["labels"] = {"pod-template-hash": HASH, "app": deployment}
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                           "name": f"{deployment}-{HASH}", "uid": f"rs-{deployment}",
                                           "controller": True}]
    uuids = tuple(service.state.nodes[node].spec.gpus[gpu + k].uuid for k in range(gpus))
    ack = AllocationAck(node=node, pod_uid=obj["metadata"]["uid"], complete=True, containers={"main": {GPU: uuids}})
    obj["metadata"]["annotations"].update(ack_annotations(ack))
    if inflight is not None:
        obj["metadata"]["annotations"]["gpupool.io/inflight"] = str(inflight)
    obj["status"]["startTime"] = started
    return obj


def gone(service: SchedulerService, server: ApiServer, obj: dict[str, Any]) -> None:
    """The ReplicaSet removed the pod."""
    server.delete(PODS, obj)
    service.on_pod("DELETED", obj)


def scale_writes(server: ApiServer) -> list[tuple[str, int]]:
    return [(path.split("/")[-2], body["spec"]["replicas"]) for method, path, body in server.written
            if method == "PATCH" and path.endswith("/scale")]


def deletion_costs(server: ApiServer) -> list[str]:
    return [path.split("/")[-1] for method, path, body in server.written
            if method == "PATCH" and "/pods/" in path
            and "controller.kubernetes.io/pod-deletion-cost" in ((body.get("metadata") or {}).get("annotations") or {})]
