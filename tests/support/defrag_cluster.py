"""What the defragmentation e2e tests share (tests/e2e/test_defrag*.py): a fragmented pool of Deployment
tenants on kwok l40s nodes, and reading the pods and Events that tell a migration's story."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from gpupool_devcluster.client import ClusterClient
from tests.support.scheduler_harness import add_pool_nodes, device_use, list_pods, pod, unique, wait_until


def bound(p: dict[str, Any]) -> bool:
    return bool(p["spec"].get("nodeName")) and not p["metadata"].get("deletionTimestamp")


def named(kube: ClusterClient, namespace: str, name: str) -> dict[str, Any] | None:
    return next((p for p in list_pods(kube, namespace) if p["metadata"]["name"] == name), None)


def tenants_of(kube: ClusterClient, namespace: str, app: str = "tenants") -> list[dict[str, Any]]:
    return [p for p in list_pods(kube, namespace)
            if p["metadata"].get("labels", {}).get("app") == app and not p["metadata"].get("deletionTimestamp")]


def events_named(kube: ClusterClient, namespace: str, reason: str) -> list[dict[str, Any]]:
    items = client.CoreV1Api(kube.api_client).list_namespaced_event(namespace, field_selector=f"reason={reason}").items
    return [{"name": e.involved_object.name, "message": e.message} for e in items]


def moves(kube: ClusterClient, namespace: str) -> list[dict[str, Any]]:
    return events_named(kube, namespace, "Moved")


def held_on(moved: list[dict[str, Any]]) -> list[str]:
    """The nodes the Moved Events say each replacement's room is held on."""
    return sorted(m["message"].rsplit("room held on node ", 1)[1].split(";")[0] for m in moved)


def deployment(kube: ClusterClient, namespace: str, app: str, replicas: int, manifest: dict[str, Any],
               annotations: dict[str, str] | None = None) -> None:
    """A Deployment `app` (its `annotations`) of `replicas` pods shaped like `manifest` (a `pod()`), labelled
    app=`app`."""
    manifest["metadata"]["labels"]["app"] = app
    manifest["spec"]["restartPolicy"] = "Always"
    del manifest["metadata"]["name"]
    client.AppsV1Api(kube.api_client).create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": app, "annotations": dict(annotations or {})},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": app}},
                 "template": {"metadata": manifest["metadata"], "spec": manifest["spec"]}}})


def fragmented_pool(kube: ClusterClient, namespace: str, scheduler: str, *, nodes: int = 2, app: str = "tenants",
                    bare: bool = False, priority_class: str | None = None,
                    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                    pod_annotations: dict[str, str] | None = None, grace_s: int = 0) -> tuple[str, list[str]]:
    """`nodes` l40s nodes (4 GPUs of 44 units each) with one 10-unit tenant per GPU, labelled app=`app`:
    the replicas of the Deployment `app` (its `annotations`), or with `bare` pods nothing recreates; the
    tenants carry `pod_annotations` and the grace period `grace_s` (kwok's `gpupool.io/stop-takes` keeps an
    evicted tenant terminating that long). Bare 34-unit fillers take a GPU each first (two never share
    one), the tenants go where 10 units are left, then the fillers go."""
    pool = unique("defrag")
    names = add_pool_nodes(kube, pool, "l40s-pcie", nodes)
    gpus = 4 * nodes
    fillers = [f"filler-{pool}-{i}" for i in range(gpus)]
    for name in fillers:
        kube.core.create_namespaced_pod(namespace, pod(name, scheduler, pool, units=34))
    wait_until(lambda: sum(1 for p in list_pods(kube, namespace) if p["metadata"]["name"] in fillers and bound(p))
               == gpus, 60, f"{gpus} fillers bound")

    def tenant(name: str) -> dict[str, Any]:
        made = pod(name, scheduler, pool, units=10, priority_class=priority_class,
                   labels={**(labels or {}), "app": app}, annotations=pod_annotations)
        made["spec"]["terminationGracePeriodSeconds"] = grace_s
        return made

    if bare:
        for i in range(gpus):
            kube.core.create_namespaced_pod(namespace, tenant(f"{app}-{i}"))
    else:
        deployment(kube, namespace, app, gpus, tenant("unused"), annotations)
    wait_until(lambda: len([p for p in tenants_of(kube, namespace, app) if bound(p)]) == gpus, 90,
               f"{gpus} tenants bound")
    for name in fillers:
        kube.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    wait_until(lambda: not [p for p in list_pods(kube, namespace) if p["metadata"]["name"] in fillers],
               60, "fillers gone")
    used, _ = device_use(kube, tenants_of(kube, namespace, app))
    assert len(used) == gpus and all(sum(use.units.values()) == 10 for use in used.values()), \
        "one 10-unit tenant per GPU"
    return pool, names
