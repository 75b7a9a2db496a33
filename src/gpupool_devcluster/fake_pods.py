"""Pods for the dev cluster's fake nodes: kwok plays their kubelet (see kwok-stages.yaml), so the image is
never pulled and `gpupool.io/run-for: <Go duration>` makes a Running pod succeed after that long."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.raw import discard, read_json

RUN_FOR_ANNOTATION = "gpupool.io/run-for"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # a name only: nothing pulls it

Progress = Callable[[int, int], None]


def pod_manifest(
    name: str,
    *,
    node_name: str | None = None,
    scheduler_name: str | None = None,
    run_for: str | None = None,
    gpus: int = 0,
    cpu: str = "100m",
    memory: str = "64Mi",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A one-container pod. `node_name` binds it directly (no scheduler); `run_for` (e.g. "30s") makes
    kwok move it to Succeeded that long after it is Running; `gpus` requests nvidia.com/gpu."""
    requests: dict[str, str] = {"cpu": cpu, "memory": memory}
    limits: dict[str, str] = {}
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": PAUSE_IMAGE,
                "resources": {"requests": requests, **({"limits": limits} if limits else {})},
            }
        ],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
    }
    if node_name:
        spec["nodeName"] = node_name
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    metadata: dict[str, Any] = {"name": name, "labels": labels or {}}
    if run_for:
        metadata["annotations"] = {RUN_FOR_ANNOTATION: run_for}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def create_pods(
    core: client.CoreV1Api,
    namespace: str,
    manifests: list[dict[str, Any]],
    *,
    concurrency: int = 32,
    progress: Progress | None = None,
) -> None:
    """Create pods concurrently without decoding the responses."""
    lock = threading.Lock()
    done = 0

    def create(body: dict[str, Any]) -> None:
        nonlocal done
        try:
            discard(core.create_namespaced_pod(namespace, body=body, _preload_content=False))
        except ApiException as exc:
            raise DevClusterError(
                f"create pod {namespace}/{body['metadata']['name']}: HTTP {exc.status} {exc.reason}"
            ) from None
        with lock:
            done += 1
            if progress:
                progress(done, len(manifests))

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(manifests) or 1))) as pool:
        for future in [pool.submit(create, body) for body in manifests]:
            future.result()


def pod_phases(core: client.CoreV1Api, namespace: str, label_selector: str = "") -> Counter[str]:
    """How many pods of the namespace are in each phase (one raw list, decoded with json)."""
    items = read_json(core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False))[
        "items"
    ]
    return Counter(item.get("status", {}).get("phase", "Unknown") for item in items)


def wait_pods_phase(
    core: client.CoreV1Api,
    namespace: str,
    phase: str,
    count: int,
    *,
    timeout_s: float,
    label_selector: str = "",
    progress: Progress | None = None,
) -> None:
    """Poll until `count` pods of the namespace are in `phase`; raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        phases = pod_phases(core, namespace, label_selector)
        if progress:
            progress(min(phases[phase], count), count)
        if phases[phase] >= count:
            return
        if time.monotonic() > deadline:
            raise DevClusterError(
                f"{phases[phase]} of {count} pods {phase} after {timeout_s:.0f}s in {namespace} ({dict(phases)})"
            )
        time.sleep(1.0)


def wait_pod_phase(core: client.CoreV1Api, namespace: str, name: str, phase: str, *, timeout_s: float) -> client.V1Pod:
    """Poll one pod until it is in `phase`; raise with its last phase and node after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == phase:
            return pod
        if time.monotonic() > deadline:
            raise DevClusterError(
                f"pod {namespace}/{name} is {pod.status.phase} on node "
                f"{pod.spec.node_name!r} after {timeout_s:.0f}s, not {phase}"
            )
        time.sleep(0.2)
