"""The Helm chart running as pods on a real node: the image `make image` built, the real kubelet with
containerd, and the device plugin on fake NVML (the one stand-in: the GPUs). Only test values change:
the image repository, the fake NVML profile, and node selectors that keep the chart's pods off the kwok
nodes. Everything else is what a user installs.

The scheduler replicas run with in-cluster config as their ServiceAccount, hold the Lease, and answer on
their Service; the device plugin registers with the real kubelet, whose node then reports the GPUs; GPU
pods of every shape are bound by the chart's scheduler, admitted by the kubelet through the plugin, and
print the devices their assignment promised; an impossible pod waits with a reason. The plugin pod is
killed and the kubelet restarted: running pods keep their GPUs and a new pod is admitted. Then the
extender mode of the chart serves the dev cluster's kube-scheduler through its Service. Uninstall leaves
no chart object and no chart container."""

from __future__ import annotations

import datetime
import os
import subprocess
import urllib.request
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_common.handshake import parse_assignment
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster import realnode
from gpupool_devcluster.binaries import helm_binary
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.cluster import DevCluster
from tests.support.chart import CHART
from tests.support.realnode_cluster import logged_env, real_cluster, wait_running, workload_pod
from tests.support.waiting import eventually

PROFILE = "nvlink-pairs"  # 8 GPUs of 80 GiB, NVLink between GPUs 2k and 2k+1
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
NS = "gpupool-system"
RELEASE = "gp"
FULLNAME = f"{RELEASE}-gpupool"


def poll(check: Any, timeout: float, what: str) -> Any:
    """`eventually`, at two reads a second: these conditions take seconds, and each read is an API call."""
    return eventually(check, timeout, what, interval=0.5)


def helm(kube: ClusterClient, *args: str) -> str:
    done = subprocess.run([str(helm_binary()), "--kubeconfig", str(kube.kubeconfig), *args],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
    return done.stdout


def chart_values(node: str) -> list[str]:
    pin = f'{{"kubernetes.io/hostname":"{node}"}}'
    return ["--set", "image.repository=gpupool", "--set", f"devicePlugin.fakeNvmlProfile={PROFILE}",
            "--set-json", f"scheduler.nodeSelector={pin}", "--set-json", f"devicePlugin.nodeSelector={pin}",
            "--set-json", f"extender.nodeSelector={pin}"]


def ready_pods(kube: ClusterClient, selector: str, count: int) -> list[Any]:
    pods = kube.core.list_namespaced_pod(NS, label_selector=selector).items
    ready = [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
             and all(s.ready for s in p.status.container_statuses or [])]
    return ready if len(ready) == count else []


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except OSError as exc:
        return 0, str(exc)


def gpu_pod(name: str, node: str, scheduler: str, *, gpus: int = 0, units: int = 0) -> dict[str, Any]:
    limits = {GPU: str(gpus)} if gpus else {MEM: str(units)}
    return workload_pod(name, node, resources={"limits": limits}, scheduler=scheduler)


def assignment_of(kube: ClusterClient, name: str, namespace: str = "default") -> Any:
    pod = kube.core.read_namespaced_pod(name, namespace)
    return parse_assignment(pod.metadata.annotations)


def check_env_matches_assignment(kube: ClusterClient, name: str) -> dict[str, str]:
    """The container's environment (its log) names exactly the devices the scheduler assigned."""
    assignment = assignment_of(kube, name)
    assert assignment is not None, f"{name} has no assignment"
    (container,) = assignment.containers
    env = logged_env(kube.core, "default", name)
    if container.memory is not None:
        assert env["NVIDIA_VISIBLE_DEVICES"] == container.memory.gpu, (name, env)
        assert int(env["GPUPOOL_MEMORY_UNITS"]) == container.memory.units
        assert int(env["GPUPOOL_MEMORY_LIMIT_MIB"]) == container.memory.units * container.memory.unit_mib
    else:
        # the same GPUs (the kubelet hands the plugin a pod's devices in its own order)
        assert sorted(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(container.devices[GPU]), (name, env)
        assert "GPUPOOL_MEMORY_LIMIT_MIB" not in env
    return env


def test_the_chart_runs_as_pods_on_a_real_kubelet() -> None:
    name = f"e2e-chart-{os.getpid()}"
    with real_cluster(name) as (cluster, kube):
        node = realnode.node_name(name, 0)
        kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
        helm(kube, "install", RELEASE, str(CHART), "--namespace", NS, *chart_values(node))
        scheduler_selector = "app.kubernetes.io/component=scheduler"
        plugin_selector = "app.kubernetes.io/component=deviceplugin"

        # the scheduler replicas: Running, in-cluster config, one holds the Lease, Service answers
        replicas = poll(lambda: ready_pods(kube, scheduler_selector, 2), 120, "2 scheduler replicas Ready")
        assert {p.spec.node_name for p in replicas} == {node}
        assert {p.spec.service_account_name for p in replicas} == {f"{FULLNAME}-scheduler"}
        coordination = client.CoordinationV1Api(kube.api_client)

        def holder() -> str | None:
            try:
                return coordination.read_namespaced_lease("gpupool-scheduler", NS).spec.holder_identity or None
            except ApiException:
                return None
        leader = poll(holder, 60, "the Lease held")
        assert leader in {p.metadata.name for p in replicas}
        service = kube.core.read_namespaced_service(f"{FULLNAME}-scheduler-metrics", NS)
        base = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
        status, text = poll(lambda: (r := http_get(f"{base}/metrics"))[0] == 200 and r, 30, "/metrics")
        assert "gpupool_scheduler" in text
        assert http_get(f"{base}/healthz")[0] == 200

        # the device plugin registers with the real kubelet; the node reports the GPUs
        poll(lambda: ready_pods(kube, plugin_selector, 1), 120, "the device plugin pod Ready")

        def capacity() -> dict[str, str] | None:
            found = kube.core.read_node(node).status.capacity or {}
            return found if found.get(GPU) == "8" and found.get(MEM) == "640" else None
        poll(capacity, 60, f"{node} reporting 8 {GPU} and 640 {MEM}")
        annotations = kube.core.read_node(node).metadata.annotations
        inventory = parse_inventory(annotations[INVENTORY_ANNOTATION])
        nvlinked = {frozenset((p.a, p.b)) for p in inventory.pairs if p.nvlinks}
        uuid_index = {g.uuid: g.index for g in inventory.gpus}

        # GPU pods of every shape: bound by the chart's scheduler, admitted by the kubelet, env as promised
        pods = {"whole": {"gpus": 1}, "share-a": {"units": 8}, "share-b": {"units": 8}, "pair": {"gpus": 2}}
        for pod_name, shape in pods.items():
            kube.core.create_namespaced_pod("default", gpu_pod(pod_name, node, "gpupool", **shape))
        for pod_name in pods:
            wait_running(kube.core, "default", pod_name, timeout_s=120)
        envs = {pod_name: check_env_matches_assignment(kube, pod_name) for pod_name in pods}
        assert envs["share-a"]["NVIDIA_VISIBLE_DEVICES"] == envs["share-b"]["NVIDIA_VISIBLE_DEVICES"], \
            "the two memory shares were not packed onto one GPU"
        pair = [uuid_index[u] for u in envs["pair"]["NVIDIA_VISIBLE_DEVICES"].split(",")]
        assert frozenset(pair) in nvlinked, f"the 2-GPU pod got GPUs {pair}, not an NVLink pair"
        taken = [envs["whole"]["NVIDIA_VISIBLE_DEVICES"], envs["share-a"]["NVIDIA_VISIBLE_DEVICES"],
                 *envs["pair"]["NVIDIA_VISIBLE_DEVICES"].split(",")]
        assert len(set(taken)) == 4, f"two pods were given one GPU: {taken}"

        # more than the node has: Pending, with the scheduler's reason
        kube.core.create_namespaced_pod("default", gpu_pod("huge", node, "gpupool", gpus=9))

        def failed_scheduling() -> list[Any]:
            events = kube.core.list_namespaced_event("default", field_selector="involvedObject.name=huge").items
            return [e for e in events if e.reason == "FailedScheduling"]
        poll(failed_scheduling, 60, "a FailedScheduling event for huge")
        assert kube.core.read_namespaced_pod("huge", "default").status.phase == "Pending"

        # the plugin pod killed and the kubelet restarted: running pods keep their GPUs, new pods admitted
        started = {p: kube.core.read_namespaced_pod(p, "default").status.container_statuses[0].state.running.started_at
                   for p in pods}
        (plugin_pod,) = ready_pods(kube, plugin_selector, 1)
        kube.core.delete_namespaced_pod(plugin_pod.metadata.name, NS, grace_period_seconds=0)
        realnode.RealNode(name, 0, cluster.layout).restart_kubelet()
        restarted = datetime.datetime.now(datetime.UTC)
        poll(lambda: [p for p in ready_pods(kube, plugin_selector, 1)
                          if p.metadata.name != plugin_pod.metadata.name], 120, "a new device plugin pod Ready")

        def registered_again() -> bool:
            """The restarted kubelet's own status reports the GPUs: the new plugin pod registered with it.
            Until its first status the node still shows the old kubelet's figures, while the new one has
            no healthy device yet: a pod bound then fails admission (UnexpectedAdmissionError), with any
            scheduler."""
            status = kube.core.read_node(node).status
            (ready,) = [c for c in status.conditions if c.type == "Ready"]
            fresh = ready.last_heartbeat_time > restarted + datetime.timedelta(seconds=1)
            return bool(fresh and ready.status == "True" and int((status.allocatable or {}).get(GPU, "0")) > 0)
        poll(registered_again, 60, "the restarted kubelet reporting nvidia.com/gpu again")
        kube.core.create_namespaced_pod("default", gpu_pod("after-restart", node, "gpupool", gpus=1))
        wait_running(kube.core, "default", "after-restart", timeout_s=120)
        check_env_matches_assignment(kube, "after-restart")
        for pod_name in pods:
            status = kube.core.read_namespaced_pod(pod_name, "default").status.container_statuses[0]
            assert status.state.running.started_at == started[pod_name] and status.restart_count == 0, pod_name
            assert check_env_matches_assignment(kube, pod_name) == envs[pod_name]

        # the chart's extender mode: kube-scheduler calls the extender pod through its Service
        helm(kube, "upgrade", RELEASE, str(CHART), "--namespace", NS, *chart_values(node),
             "--set", "extender.enabled=true", "--set", "scheduler.enabled=false",
             "--set", "schedulerName=gpupool-extender")
        poll(lambda: ready_pods(kube, "app.kubernetes.io/component=extender", 1), 120, "the extender Ready")
        extender = kube.core.read_namespaced_service(f"{FULLNAME}-extender", NS)
        url = f"http://{extender.spec.cluster_ip}:{extender.spec.ports[0].port}"
        cluster.start_kube_scheduler(scheduler_name="gpupool-extender", tag="kube-scheduler-extender",
                                     extra_config=_extender_config(url))
        kube.core.create_namespaced_pod("default", gpu_pod("via-extender", node, "gpupool-extender", gpus=1))
        wait_running(kube.core, "default", "via-extender", timeout_s=120)
        check_env_matches_assignment(kube, "via-extender")

        helm(kube, "uninstall", RELEASE, "--namespace", NS, "--wait")
        poll(lambda: not kube.core.list_namespaced_pod(NS).items, 60, "the chart's pods gone")
        assert not client.AppsV1Api(kube.api_client).list_namespaced_deployment(NS).items
        assert not client.AppsV1Api(kube.api_client).list_namespaced_daemon_set(NS).items
        assert [s.metadata.name for s in kube.core.list_namespaced_service(NS).items] == []
        assert not [r for r in client.RbacAuthorizationV1Api(kube.api_client).list_cluster_role().items
                    if r.metadata.name.startswith(FULLNAME)]
        _no_container_left_of(cluster, name, "gpupool:")


def _extender_config(url: str) -> dict[str, object]:
    """The `extenders:` entry of docs/extender.md, pointed at the chart's Service."""
    return {"extenders": [{
        "urlPrefix": url, "filterVerb": "filter", "prioritizeVerb": "prioritize", "preemptVerb": "preempt",
        "bindVerb": "bind", "weight": 100, "enableHTTPS": False, "httpTimeout": "30s", "nodeCacheCapable": True,
        "managedResources": [{"name": GPU, "ignoredByScheduler": True}, {"name": MEM, "ignoredByScheduler": True}],
        "ignorable": False,
    }]}


def _no_container_left_of(cluster: DevCluster, name: str, image_prefix: str) -> None:
    """No container of the gpupool image still runs on the node (the kubelet stopped them all)."""
    node = realnode.RealNode(name, 0, cluster.layout)

    def running() -> list[str]:
        done = subprocess.run(["ctr", "--address", str(node.socket), "-n", "k8s.io", "containers", "ls"],
                              capture_output=True, text=True, check=True)
        listed = [line for line in done.stdout.splitlines()[1:] if image_prefix in line]
        tasks = subprocess.run(["ctr", "--address", str(node.socket), "-n", "k8s.io", "tasks", "ls"],
                               capture_output=True, text=True, check=True).stdout
        return [line for line in listed if line.split()[0] in tasks]
    poll(lambda: not running(), 60, f"no {image_prefix} container running")
