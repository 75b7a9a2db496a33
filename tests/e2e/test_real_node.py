"""Real nodes on the dev cluster (`gpupool dev-cluster up --with kubelet`): the pinned kubelet and
kube-proxy with Debian's containerd and runc, each node in its own network namespace. A pod placed by
kube-scheduler runs there, its log comes back through kube-apiserver and the kubelet, it reaches
kube-apiserver through the `kubernetes` Service; the pods outlive a kubelet restart; `down` leaves no
process, mount, cgroup, network namespace, link or iptables rule behind."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from kubernetes import client

from gpupool_devcluster import realnode
from gpupool_devcluster.cluster import DevCluster
from tests.support.realnode_cluster import logged_env, machine_leftovers, real_cluster, wait_running, workload_pod


def test_a_real_node_runs_pods_survives_a_kubelet_restart_and_leaves_nothing_behind() -> None:
    name = f"e2e-node-{os.getpid()}"
    with real_cluster(name) as (cluster, kube):
        node_name = realnode.node_name(name, 0)
        node = kube.core.read_node(node_name)
        assert node.metadata.labels["gpupool.io/real-node"] == "true"
        assert node.status.node_info.kubelet_version == cluster.state().kubernetes_version  # type: ignore[union-attr]
        assert node.status.node_info.container_runtime_version.startswith("containerd://")
        net = cluster.node_net()
        assert net is not None
        assert [a.address for a in node.status.addresses if a.type == "InternalIP"] == [net.node_ip(0)]

        ns = "default"
        kube.core.create_namespaced_pod(ns, workload_pod("hello", node_name, env={"GREETING": "from-a-real-node"}))
        pod = wait_running(kube.core, ns, "hello")  # kube-scheduler placed it; runc runs it
        assert pod.spec.node_name == node_name
        assert pod.status.pod_ip.startswith(net.pod_cidr(0).rsplit(".", 2)[0])
        env = logged_env(kube.core, ns, "hello")  # the log: kube-apiserver -> the kubelet -> containerd
        assert env["GREETING"] == "from-a-real-node"
        assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"

        # a pod reaches kube-apiserver as on a real cluster: ClusterIP -> kube-proxy -> the endpoint
        pid = _container_pid(cluster, "hello")
        version = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "curl", "-sk", "-m", "10", "https://10.96.0.1:443/version"],
            capture_output=True, text=True, check=False)
        assert '"gitVersion"' in version.stdout, version

        started = pod.status.container_statuses[0].state.running.started_at
        real = realnode.RealNode(name, 0, cluster.layout)
        real.restart_kubelet()
        time.sleep(8)  # the restarted kubelet re-syncs its pods
        again = wait_running(kube.core, ns, "hello")
        assert again.status.container_statuses[0].state.running.started_at == started
        assert again.status.container_statuses[0].restart_count == 0
        assert _container_pid(cluster, "hello") == pid

        kube.core.delete_namespaced_pod("hello", ns, body=client.V1DeleteOptions(grace_period_seconds=1))
        kube.core.create_namespaced_pod(ns, workload_pod("left-running", node_name))
        wait_running(kube.core, ns, "left-running")  # `down` must take this one away too
        assert machine_leftovers(cluster, net, 1) != []  # the check sees a running node
    assert machine_leftovers(cluster, net, 1) == []
    assert not realnode.RealNode(name, 0, cluster.layout).kubelet_dir.exists()
    cluster.down(purge=True)


def _container_pid(cluster: DevCluster, marker_pod: str) -> int:
    """The pid of the workload process (the only non-pause process in this cluster's cgroup root)."""
    node = realnode.RealNode(cluster.name, 0, cluster.layout)
    for folder in node.cgroups():
        if folder.parent.name != "pids":
            continue
        for procs in folder.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if comm != "pause":
                    return int(pid)
    raise AssertionError(f"no workload process of {marker_pod} in {node.cgroup_root}")
