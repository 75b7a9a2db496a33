"""Idle GPUs reclaimed on the real control plane (issue 20 §2): the scheduler process, the kube-apiserver's
Eviction API, kwok nodes.

`test_the_real_plugin_names_the_idle_pod_and_the_scheduler_reclaims_it`: the device plugin process (fake NVML
scripted through its events file, a 1 s window) writes gpupool.io/idle-pods for the one pod whose GPU does
nothing, never for a bursty pod (busy 0.2 s every 0.8 s); a pending pod within its guarantee takes the idle
pod's GPU and nothing busy or bursty goes.

`test_an_idle_pod_is_reclaimed_for_a_guaranteed_pod_and_nothing_else_is` writes the annotation itself, as the
plugin's stand-in, to list pods the plugin would not (one in its start grace, one annotated never). One
dgx-h100 node (8 GPUs), full of one-GPU pods:

* (a) `others/idle`, listed idle past its GpuQuota's idleAfter (60 s, reclaimWhenNeeded), is evicted for
  `team/train`, pending within its guarantee; the Events say how long it was idle, where, and for whom;
* (b) the busy pods (not listed), `others/young` (listed, but in its start grace) and `others/never`
  (listed, annotated gpupool.io/idle-reclaim: never) stay;
* (c) `rep/report`, listed idle under a quota whose action is report, gets an IdleGPU Event and stays;
* then `sweep/lazy`, listed idle under a quota whose action is reclaim, is evicted with no pod waiting.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import parse_assignment
from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, idle_pods_annotation, parse_idle_pods
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from tests.support.fixtures import drop_namespace, make_namespace
from tests.support.plugin_process import PluginProcess
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    stop_scheduler,
    unique,
    wait_bound,
    wait_until,
)

GROUP, VERSION, PLURAL = "gpupool.io", "v1alpha1", "gpuquotas"
START_GRACE_S = 8.0  # the scheduler's --idle-start-grace here (300 s by default)


def quota(kube: ClusterClient, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(kube.api_client).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)


def delete_quota(kube: ClusterClient, name: str) -> None:
    try:
        client.CustomObjectsApi(kube.api_client).delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def cluster(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    install_crds(kube.api_client)
    tag = uuid.uuid4().hex[:6]
    pool = unique("idle")
    nodes = add_pool_nodes(kube, pool, "dgx-h100", 1)
    spaces = {team: make_namespace(kube, prefix=team, labels={"idle-team": f"{team}-{tag}"})
              for team in ("team", "others", "rep", "sweep")}
    names = {team: f"idle-{team}-{tag}" for team in spaces}

    def select(team: str) -> dict[str, Any]:
        return {"matchLabels": {"idle-team": f"{team}-{tag}"}}

    quota(kube, names["team"], {"namespaceSelector": select("team"), "guaranteed": {"gpus": 1}})
    quota(kube, names["others"], {"namespaceSelector": select("others"), "guaranteed": {"gpus": 8},
                                  "idleReclaim": {"idleAfter": 60}})  # action: reclaimWhenNeeded (the default)
    quota(kube, names["rep"], {"namespaceSelector": select("rep"), "guaranteed": {"gpus": 1},
                               "idleReclaim": {"idleAfter": "1m", "action": "report"}})
    quota(kube, names["sweep"], {"namespaceSelector": select("sweep"), "guaranteed": {"gpus": 1},
                                 "idleReclaim": {"idleAfter": "1m", "action": "reclaim"}})
    proc: SchedulerProcess | None = None
    try:
        proc = start_scheduler(kube, unique("gpupool"), Path(tmp_path_factory.mktemp("idle-logs")),
                               "--idle-start-grace", str(int(START_GRACE_S)))
        yield {"pool": pool, "node": nodes[0], "ns": spaces, "quotas": names, "scheduler": proc}
        stop_scheduler(proc)
        proc = None
    finally:
        if proc is not None:
            proc.stop()
        for name in names.values():
            delete_quota(kube, name)
        for ns in spaces.values():
            drop_namespace(kube, ns)
        kube.delete_nodes(nodes)


def uid_of(kube: ClusterClient, namespace: str, name: str) -> str:
    return str(next(p for p in list_pods(kube, namespace) if p["metadata"]["name"] == name)["metadata"]["uid"])


def alive(kube: ClusterClient, namespace: str) -> set[str]:
    return {p["metadata"]["name"] for p in list_pods(kube, namespace)
            if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")}


def test_an_idle_pod_is_reclaimed_for_a_guaranteed_pod_and_nothing_else_is(kube: ClusterClient,
                                                                           cluster: dict[str, Any]) -> None:
    pool, node, ns, proc = cluster["pool"], cluster["node"], cluster["ns"], cluster["scheduler"]
    sched = proc.name
    old = ["idle", "busy-0", "busy-1", "busy-2", "never"]
    for name in old:
        annotations = {"gpupool.io/idle-reclaim": "never"} if name == "never" else None
        kube.core.create_namespaced_pod(ns["others"], pod(name, sched, pool, gpus=1, annotations=annotations))
    kube.core.create_namespaced_pod(ns["rep"], pod("report", sched, pool, gpus=1))
    kube.core.create_namespaced_pod(ns["sweep"], pod("lazy", sched, pool, gpus=1))
    wait_bound(kube, ns["others"], len(old), timeout_s=60)
    wait_bound(kube, ns["rep"], 1, timeout_s=60)
    wait_bound(kube, ns["sweep"], 1, timeout_s=60)
    time.sleep(START_GRACE_S + 1)  # the pods above are out of their start grace; `young` will not be
    kube.core.create_namespaced_pod(ns["others"], pod("young", sched, pool, gpus=1))
    wait_bound(kube, ns["others"], len(old) + 1, timeout_s=60)

    # the device plugin's stand-in: idle for 2 minutes (past the quotas' idleAfter of 60 s); busy-* not listed
    since = datetime.now(UTC).timestamp() - 120
    listed = {uid_of(kube, ns["others"], n): since for n in ("idle", "never", "young")}
    listed[uid_of(kube, ns["rep"], "report")] = since
    kube.core.patch_node(node, {"metadata": {"annotations": {IDLE_PODS_ANNOTATION: idle_pods_annotation(listed)}}})

    # (c) report only reports
    (reported,) = wait_until(lambda: events_for(kube, ns["rep"], "report", "IdleGPU"), 30, "report: IdleGPU Event")
    assert f"on node {node}, past idleAfter 1m; the idle policy of GpuQuota {cluster['quotas']['rep']} only " \
           "reports: nothing is reclaimed" in reported["message"], reported["message"]
    assert reported["message"].startswith("Idle on its GPUs for 2m"), reported["message"]

    # (a) the full node: a pending pod within its guarantee takes the idle pod's GPU
    kube.core.create_namespaced_pod(ns["team"], pod("train", sched, pool, gpus=1))
    wait_bound(kube, ns["team"], 1, timeout_s=60)
    (reclaimed,) = wait_until(lambda: events_for(kube, ns["others"], "idle", "IdleReclaimed"), 30,
                              "idle: IdleReclaimed Event")
    message = reclaimed["message"]
    assert message.startswith("Idle for 2m") and f"on node {node}; its GPUs were needed by {ns['team']}/train " \
        f"(within its guarantee of GpuQuota {cluster['quotas']['team']})" in message, message
    (preempting,) = events_for(kube, ns["team"], "train", "Preempting")
    assert preempting["message"] == (f"Preempting 1 pod(s) idle on their GPUs past their idleAfter on node {node}: "
                                     f"{ns['others']}/idle"), preempting["message"]

    # (b) nothing busy, young or annotated never went; report's pod stays
    wait_until(lambda: "idle" not in alive(kube, ns["others"]), 30, "idle gone")
    assert alive(kube, ns["others"]) == {"busy-0", "busy-1", "busy-2", "never", "young"}
    assert alive(kube, ns["rep"]) == {"report"}
    assert alive(kube, ns["sweep"]) == {"lazy"}  # busy so far: not listed
    assert proc.metric("gpupool_scheduler_idle_reclaims_total", reason="needed", result="evicted") == 1
    assert proc.metric("gpupool_scheduler_idle_pods", action="report") == 1

    # action reclaim: evicted once listed idle past idleAfter, no pod waiting
    listed[uid_of(kube, ns["sweep"], "lazy")] = since
    kube.core.patch_node(node, {"metadata": {"annotations": {IDLE_PODS_ANNOTATION: idle_pods_annotation(listed)}}})
    (swept,) = wait_until(lambda: events_for(kube, ns["sweep"], "lazy", "IdleReclaimed"), 30,
                          "lazy: IdleReclaimed Event")
    assert swept["message"].endswith(f"on node {node}; the idle policy of GpuQuota {cluster['quotas']['sweep']} is "
                                     "reclaim: idle past idleAfter 1m"), swept["message"]
    wait_until(lambda: not alive(kube, ns["sweep"]), 30, "lazy gone")
    assert proc.metric("gpupool_scheduler_idle_reclaims_total", reason="policy", result="evicted") == 1
    assert alive(kube, ns["others"]) == {"busy-0", "busy-1", "busy-2", "never", "young"}
    assert alive(kube, ns["rep"]) == {"report"}


def test_the_real_plugin_names_the_idle_pod_and_the_scheduler_reclaims_it(
        kube: ClusterClient, tmp_path: Path) -> None:
    install_crds(kube.api_client)
    tag = uuid.uuid4().hex[:6]
    pool = unique("idlep")
    (node,) = add_pool_nodes(kube, pool, "l40s-pcie", 1)  # 4 GPUs
    team = make_namespace(kube, prefix="team", labels={"idle-team": f"team-{tag}"})
    others = make_namespace(kube, prefix="others")
    qname = f"idle-team-{tag}"
    quota(kube, qname, {"namespaceSelector": {"matchLabels": {"idle-team": f"team-{tag}"}}, "guaranteed": {"gpus": 1}})
    proc: SchedulerProcess | None = None
    plugin: PluginProcess | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="gpk-") as kubelet_dir:  # unix socket paths stay short
            uuids = [g.uuid for g in parse_inventory(kube.core.read_node(node).metadata.annotations[
                INVENTORY_ANNOTATION]).gpus]
            plugin = PluginProcess(tmp_path, Path(kubelet_dir), "l40s-pcie", node=node, kubeconfig=kube.kubeconfig,
                                   config={"idle": {"publishIntervalSeconds": 0}},
                                   extra_args=["--idle-sample-interval", "0.2", "--idle-window", "1",
                                               "--idle-start-grace", "0"])
            with plugin.events.open("a") as fh:  # every GPU works...
                for u in uuids:
                    fh.write(json.dumps({"uuid": u, "activity": {"utilization": 70, "memoryUsedMiB": 8000}}) + "\n")
            plugin.start()
            plugin.wait_log(r"idle sampling every 0.2s")
            proc = start_scheduler(kube, unique("gpupool"), tmp_path, "--idle-reclaim-action", "reclaimWhenNeeded",
                                   "--idle-after", "2", "--idle-start-grace", "0")
            for i in range(4):
                kube.core.create_namespaced_pod(others, pod(f"w-{i}", proc.name, pool, gpus=1))
            bound = wait_bound(kube, others, 4, timeout_s=60)
            def gpu_of(name: str) -> str:
                found = next(p for p in bound if p["metadata"]["name"] == name)
                assignment = parse_assignment(found["metadata"].get("annotations"))
                assert assignment is not None
                (gpu,) = assignment.containers[0].devices["nvidia.com/gpu"]
                return str(gpu)

            chosen = next(p for p in bound if p["metadata"]["name"] == "w-2")
            with plugin.events.open("a") as fh:  # ...until w-2's GPU does nothing, and w-1's works in bursts
                fh.write(json.dumps({"uuid": gpu_of("w-2"), "activity": {"utilization": 0, "memoryUsedMiB": 8000}})
                         + "\n")
                # busy 0.2 s every 0.8 s: quiet most of the time, never for a whole 1 s window
                fh.write(json.dumps({"uuid": gpu_of("w-1"), "activity": {
                    "utilization": 60, "memoryUsedMiB": 8000, "burst": {"everyS": 0.8, "busyS": 0.2}}}) + "\n")

            def listed() -> set[str]:
                return set(parse_idle_pods((kube.core.read_node(node).metadata.annotations or {})
                                           .get(IDLE_PODS_ANNOTATION)))

            wait_until(lambda: listed() == {chosen["metadata"]["uid"]}, 30, "the plugin lists w-2 idle, alone")
            seen: set[str] = set()
            deadline = time.monotonic() + 4.0  # past --idle-after, the bursty w-1 is never listed meanwhile
            while time.monotonic() < deadline:
                seen |= listed()
                time.sleep(0.1)
            assert seen == {chosen["metadata"]["uid"]}, seen
            kube.core.create_namespaced_pod(team, pod("train", proc.name, pool, gpus=1))
            wait_bound(kube, team, 1, timeout_s=60)
            (reclaimed,) = wait_until(lambda: events_for(kube, others, "w-2", "IdleReclaimed"), 30,
                                      "w-2: IdleReclaimed Event")
            assert f"on node {node}; its GPUs were needed by {team}/train (within its guarantee of GpuQuota " \
                f"{qname})" in reclaimed["message"], reclaimed["message"]
            wait_until(lambda: "w-2" not in alive(kube, others), 30, "w-2 gone")
            assert alive(kube, others) == {"w-0", "w-1", "w-3"}
            stop_scheduler(proc)
            proc = None
    finally:
        if proc is not None:
            proc.stop()
        if plugin is not None:
            plugin.stop()
        delete_quota(kube, qname)
        drop_namespace(kube, team)
        drop_namespace(kube, others)
        kube.delete_nodes([node])
