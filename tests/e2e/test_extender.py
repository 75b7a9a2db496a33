"""`gpupool extender` behind the pinned kube-scheduler on the local control plane: kube-scheduler keeps
its queue and plugins, the extender filters and scores the nodes of GPU pods and binds them (bindVerb)
with the GPU assignment the device plugin hands out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpupool_common.handshake import parse_assignment
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from gpupool_devcluster.raw import discard
from tests.support.ports import free_port
from tests.support.scheduler_harness import (
    add_pool_nodes,
    assert_no_oversubscription,
    device_use,
    list_pods,
    pod,
    unique,
    wait_bound,
    wait_until,
)

GPU = "nvidia.com/gpu"
MEMORY = "nvidia.com/gpu-memory"


def extender_config(port: int) -> dict[str, object]:
    """The `extenders:` entry of docs/extender.md."""
    return {"extenders": [{
        "urlPrefix": f"http://127.0.0.1:{port}",
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "preemptVerb": "preempt",
        "bindVerb": "bind",
        "weight": 100,
        "enableHTTPS": False,
        "httpTimeout": "30s",
        "nodeCacheCapable": True,
        "managedResources": [{"name": GPU, "ignoredByScheduler": True},
                             {"name": MEMORY, "ignoredByScheduler": True}],
        "ignorable": False,
    }]}


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


@pytest.fixture
def extender(kube: ClusterClient, tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    name = unique("ext")
    port = free_port()
    log = tmp_path / "extender.log"
    gpupool = str(Path(sys.executable).parent / "gpupool")
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            [gpupool, "extender", "--port", str(port), "--kubeconfig", str(kube.kubeconfig),
             "--scheduler-name", name, "--log-level", "debug"],
            stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: process.poll() is not None or get(port, "/readyz")[0] == 200,
                   60, "the extender ready")
        assert process.poll() is None, log.read_text()[-3000:]
        # kube-scheduler retries a pod the extender refused on the next cluster event; when the extender's
        # watch shows that event later than kube-scheduler's does (a freed GPU of the team's quota), the retry
        # finds the old state and the pod waits for podMaxInUnschedulablePodsDuration (5 min by default;
        # docs/extender.md, Limits): 15 s here, so the test waits for what a user would eventually see
        scheduler = kube.start_kube_scheduler(name, tag=f"kube-scheduler-{name}", extra_config=extender_config(port),
                                              extra_args=("--pod-max-in-unschedulable-pods-duration=15s",))
        try:
            yield name, port, log
        finally:
            scheduler.stop()
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()


def test_kube_scheduler_places_gpu_pods_through_the_extender(
    kube: ClusterClient, namespace: str, extender: tuple[str, int, Path]
) -> None:
    name, port, log = extender
    pool = unique("extpool")
    add_pool_nodes(kube, pool, "l40s-pcie", 3)  # 4 GPUs of 46 GiB each: 44 units per GPU at 1 GiB

    def create(manifest: dict[str, object]) -> None:
        discard(kube.core.create_namespaced_pod(namespace, manifest, _preload_content=False))

    # two memory-unit pods, one after the other: the core packs the second onto the first one's GPU
    create(pod("share-a", name, pool, units=8))
    wait_bound(kube, namespace, 1, timeout_s=60)
    create(pod("share-b", name, pool, units=8))
    wait_bound(kube, namespace, 2, timeout_s=60)
    for i in range(3):
        create(pod(f"whole-{i}", name, pool, gpus=2))
    pods = wait_bound(kube, namespace, 5, timeout_s=90)

    by_name = {p["metadata"]["name"]: p for p in pods}
    for p in pods:  # kube-scheduler's own binder writes no annotations: these Bindings are the extender's
        assignment = parse_assignment(p["metadata"].get("annotations"))
        assert assignment is not None, f"{p['metadata']['name']}: no assignment annotation ({log.read_text()[-2000:]})"
        assert assignment.node == p["spec"]["nodeName"]
        assert assignment.pod_uid == p["metadata"]["uid"]
    gpus, _ = device_use(kube, pods)
    shared = [(key, use) for key, use in gpus.items() if use.units]
    assert len(shared) == 1, f"the two shares are on {len(shared)} GPUs: {shared}"
    (node, _), use = shared[0]
    assert set(use.units) == {f"{namespace}/share-a", f"{namespace}/share-b"}
    assert use.units == {f"{namespace}/share-a": 8, f"{namespace}/share-b": 8}
    assert by_name["share-a"]["spec"]["nodeName"] == by_name["share-b"]["spec"]["nodeName"] == node
    wholes = [use for use in gpus.values() if use.whole]
    assert len(wholes) == 6  # 3 pods × 2 GPUs, none on the shared GPU
    assert_no_oversubscription(kube, pods)

    status, metrics = get(port, "/metrics")
    assert status == 200
    binds = [line for line in metrics.splitlines()
             if line.startswith('gpupool_extender_request_duration_seconds_count{verb="bind"}')]
    assert binds and float(binds[0].split()[-1]) >= 5, binds
    for verb in ("filter", "prioritize"):
        assert f'gpupool_extender_request_duration_seconds_count{{verb="{verb}"}}' in metrics


def test_a_pod_that_fits_no_node_stays_pending_with_the_extenders_reason(
    kube: ClusterClient, namespace: str, extender: tuple[str, int, Path]
) -> None:
    name, _, _ = extender
    pool = unique("extpool")
    add_pool_nodes(kube, pool, "l40s-pcie", 1)
    discard(kube.core.create_namespaced_pod(namespace, pod("too-big", name, pool, gpus=8), _preload_content=False))

    def reason() -> str | None:
        p = list_pods(kube, namespace)[0]
        for c in (p.get("status") or {}).get("conditions") or ():
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                return str(c["message"])
        return None

    message = wait_until(reason, 60, "PodScheduled=False on the pod")
    assert "GPU" in message or GPU in message, message
    assert not list_pods(kube, namespace)[0]["spec"].get("nodeName")


@pytest.fixture
def team_quota(kube: ClusterClient, namespace: str) -> Iterator[str]:
    """The test's namespace labelled as a team with a GpuQuota of 2 GPUs and no borrowing, made before the
    extender starts (its start-up LIST sees both; later changes come through its watch)."""
    install_crds(kube.api_client)
    tag = unique("team")
    kube.core.patch_namespace(namespace, {"metadata": {"labels": {"gpupool-test/team": tag}}})
    name = unique("extq")
    body = {"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuQuota", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"gpupool-test/team": tag}}, "guaranteed": {"gpus": 2}}}
    api = client.CustomObjectsApi(kube.api_client)
    api.create_cluster_custom_object("gpupool.io", "v1alpha1", "gpuquotas", body)
    yield name
    api.delete_cluster_custom_object("gpupool.io", "v1alpha1", "gpuquotas", name)


def test_a_team_over_its_gpuquota_waits_with_the_quotas_reason_until_a_pod_ends(
    kube: ClusterClient, namespace: str, team_quota: str, extender: tuple[str, int, Path]
) -> None:
    name, _, _ = extender
    pool = unique("extquota")
    add_pool_nodes(kube, pool, "l40s-pcie", 1)  # 4 GPUs: the node has room, the quota does not
    for i in range(3):
        discard(kube.core.create_namespaced_pod(namespace, pod(f"q-{i}", name, pool, gpus=1),
                                                _preload_content=False))
    wait_bound(kube, namespace, 2)

    def waiting() -> tuple[str, str] | None:
        for p in list_pods(kube, namespace):
            for c in (p.get("status") or {}).get("conditions") or ():
                if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                    return str(p["metadata"]["name"]), str(c["message"])
        return None

    pending, message = wait_until(waiting, 60, "the third pod refused by the quota")
    assert team_quota in message, message
    time.sleep(2.0)  # kube-scheduler's retries keep failing: still 2 bound
    assert sum(1 for p in list_pods(kube, namespace) if p["spec"].get("nodeName")) == 2
    done = next(p["metadata"]["name"] for p in list_pods(kube, namespace) if p["spec"].get("nodeName"))
    kube.core.delete_namespaced_pod(done, namespace, grace_period_seconds=0)
    wait_until(lambda: any(p["metadata"]["name"] == pending and p["spec"].get("nodeName")
                           for p in list_pods(kube, namespace)), 60, "the waiting pod bound once a pod ended")
