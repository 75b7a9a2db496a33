"""Smoke test of the local control plane: the real apiserver with TLS, tokens and RBAC, listening on
loopback only; 100 fake GPU nodes from mixed device-plugin profiles; a bound pod that runs and completes;
the real kube-scheduler; the pinned helm."""

from __future__ import annotations

import datetime as dt
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.binaries import helm_binary, pinned_version
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_nodes import PROFILE_LABEL
from gpupool_devcluster.fake_pods import create_pods, pod_manifest, wait_pod_phase
from gpupool_devcluster.kubeconfig import api_client
from gpupool_deviceplugin.publication import node_publication_for_profile

PROFILES = ("dgx-h100", "l40s-pcie", "nvlink-pairs", "a100-mig")


def _http_status(url: str, ca: Path, token: str | None = None) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _listening_addresses(pid: int) -> set[str]:
    """Local IPv4/IPv6 addresses of the TCP sockets `pid` listens on (from /proc, no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(local.split(":")[0])
                if len(raw) == 4:
                    addresses.add(".".join(str(b) for b in reversed(raw)))
                else:
                    addresses.add(raw.hex())
    return addresses


def _scheduled_event_by(kube: ClusterClient, namespace: str, pod: str, scheduler_name: str) -> bool:
    """Whether `scheduler_name` reported binding `pod` (its events may trail the binding briefly)."""
    events = client.EventsV1Api(kube.api_client)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for event in events.list_namespaced_event(namespace).items:
            if (event.regarding.name == pod and event.reason == "Scheduled"
                    and event.reporting_controller == scheduler_name):
                return True
        time.sleep(0.2)
    return False


def test_apiserver_is_the_pinned_release_with_tls_token_auth_and_rbac(kube: ClusterClient) -> None:
    info = client.VersionApi(kube.api_client).get_code()
    assert info.git_version == pinned_version("kubernetes")
    assert (info.major, info.minor) == ("1", pinned_version("kubernetes").split(".")[1])

    ca = kube.cluster.layout.pki.ca_cert
    assert kube.server.startswith("https://127.0.0.1:")
    assert _http_status(f"{kube.server}/api/v1/nodes", ca) == 403  # anonymous: authenticated, not allowed
    assert _http_status(f"{kube.server}/api/v1/nodes", ca, token="not-a-token") == 401

    # the scheduler's token is the bootstrap user system:kube-scheduler: it may read nodes, not delete them
    scheduler = client.CoreV1Api(api_client(kube.cluster.layout.component_kubeconfig("kube-scheduler")))
    scheduler.list_node(limit=1)
    with pytest.raises(ApiException) as denied:
        scheduler.delete_collection_namespaced_pod("default")
    assert denied.value.status == 403
    scheduler.api_client.close()


def test_every_process_listens_on_loopback_only(kube: ClusterClient) -> None:
    processes = {name: p for name, p in kube.cluster.processes().items() if p.alive()}
    assert {"etcd", "kube-apiserver", "kwok"} <= set(processes)
    for name, process in processes.items():
        addresses = _listening_addresses(process.pid)
        assert addresses, f"{name} listens on nothing"
        assert addresses <= {"127.0.0.1"}, f"{name} listens on {addresses}"


def test_hundred_mixed_gpu_nodes_are_ready_with_what_the_device_plugin_publishes(kube: ClusterClient) -> None:
    batch = uuid.uuid4().hex[:6]
    names = {profile: kube.add_nodes(profile, 25, prefix=f"smoke-{batch}-{profile}-") for profile in PROFILES}
    assert sum(len(n) for n in names.values()) == 100

    nodes = {n.metadata.name: n for n in kube.core.list_node().items}
    for profile, profile_names in names.items():
        for name in profile_names:
            node = nodes[name]
            ready = [c for c in node.status.conditions if c.type == "Ready"]
            assert ready and ready[0].status == "True", f"{name} not Ready"
            published = node_publication_for_profile(profile, node_name=name)
            expected = {**published.host_capacity, **published.capacity}
            assert node.status.capacity == expected
            assert node.status.allocatable == expected
            assert published.labels.items() <= node.metadata.labels.items()
            assert node.metadata.labels[PROFILE_LABEL] == profile
            assert published.annotations.items() <= node.metadata.annotations.items()
            assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"
    # the profiles really differ: MIG slices only on a100-mig, 4 GPUs on l40s-pcie
    a100 = nodes[names["a100-mig"][0]].status.capacity
    assert any(key.startswith("nvidia.com/mig-") for key in a100)
    assert nodes[names["l40s-pcie"][0]].status.capacity["nvidia.com/gpu"] == "4"


def test_pod_bound_by_node_name_runs_then_succeeds_after_run_for(kube: ClusterClient, namespace: str) -> None:
    node = kube.add_nodes("l40s-pcie", 1, prefix=f"smoke-{uuid.uuid4().hex[:6]}-bound-")[0]
    create_pods(kube.core, namespace, [
        pod_manifest("finite", node_name=node, run_for="3s", gpus=1),
        pod_manifest("forever", node_name=node),
    ])
    running = wait_pod_phase(kube.core, namespace, "finite", "Running", timeout_s=30)
    assert running.status.pod_ip and running.status.container_statuses[0].ready

    done = wait_pod_phase(kube.core, namespace, "finite", "Succeeded", timeout_s=30)
    terminated = done.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 0 and terminated.reason == "Completed"
    ran_for = terminated.finished_at - done.status.start_time
    # timestamps have 1 s resolution: 3 s of run-for is 2..4 s on the record, plus kwok's reaction time
    assert dt.timedelta(seconds=2) <= ran_for <= dt.timedelta(seconds=15), ran_for

    forever = kube.core.read_namespaced_pod("forever", namespace)
    assert forever.status.phase == "Running"  # no run-for annotation: it never completes by itself


def test_kube_scheduler_binary_schedules_a_plain_pod(kube: ClusterClient, namespace: str) -> None:
    kube.add_nodes("dgx-h100", 2, prefix=f"smoke-{uuid.uuid4().hex[:6]}-sched-")
    scheduler_name = f"e2e-{uuid.uuid4().hex[:6]}"  # its own profile: no other scheduler takes the pod
    scheduler = kube.start_kube_scheduler(scheduler_name, tag=f"kube-scheduler-{scheduler_name}")
    try:
        create_pods(kube.core, namespace, [pod_manifest("plain", scheduler_name=scheduler_name, gpus=1)])
        pod = wait_pod_phase(kube.core, namespace, "plain", "Running", timeout_s=60)
        assert pod.spec.node_name, "running without a node"
        node = kube.core.read_node(pod.spec.node_name)
        assert int(node.status.allocatable["nvidia.com/gpu"]) >= 1
        assert _scheduled_event_by(kube, namespace, "plain", scheduler_name)
    finally:
        scheduler.stop()
    assert not scheduler.alive()


def test_pinned_helm_talks_to_the_cluster(kube: ClusterClient, namespace: str) -> None:
    helm = helm_binary()
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith(pinned_version("helm"))
    listing = subprocess.run([str(helm), "list", "--namespace", namespace, "--kubeconfig", str(kube.kubeconfig),
                              "--output", "json"], capture_output=True, text=True, timeout=60, check=False)
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout) == []
