"""The network of a dev cluster's real nodes: one host bridge per cluster, one network namespace per node.

    host (kube-apiserver on 127.0.0.1:P)
      gpbr<k>  10.250.<k>.1/24   PREROUTING: -d 10.250.<k>.1 --dport P -> DNAT 127.0.0.1:P (route_localnet)
        | veth gpv<k>n<i>
    netns gpupool-<cluster>-node-<i>: eth0 10.250.<k>.<10+i>, kubelet, containerd, kube-proxy
      cni0 10.<200+i>.<k>.1/24 (CNI bridge, host-local IPAM, ipMasq) -- pods

kube-apiserver keeps listening on 127.0.0.1 only; the nodes and their pods reach it at 10.250.<k>.1, which
the host's NAT table maps to the loopback port (the kernel's route_localnet allows exactly that, on this
bridge only). The `kubernetes` Service's EndpointSlice names that address, so kube-proxy in each node sends
pods there as on a real cluster. Everything is named after the cluster's index <k>, chosen free under a
lock, so `down` removes exactly what `up` made.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpupool_devcluster.errors import DevClusterError

RUN_ROOT = Path("/run/gpupool")
NETNS_DIR = Path("/run/netns")
MAX_NODES = 50


def sh(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command (in the network namespace `netns` if given); DevClusterError with its stderr on failure."""
    full = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    done = subprocess.run(full, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise DevClusterError(f"`{' '.join(full)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class ClusterNet:
    """The addresses of one cluster's node network (index `k` in 1..254)."""

    k: int
    apiserver_port: int

    @property
    def bridge(self) -> str:
        return f"gpbr{self.k}"

    @property
    def host_ip(self) -> str:
        return f"10.250.{self.k}.1"

    def node_ip(self, i: int) -> str:
        return f"10.250.{self.k}.{10 + i}"

    def pod_cidr(self, i: int) -> str:
        return f"10.{200 + i}.{self.k}.0/24"

    def veth(self, i: int) -> str:
        return f"gpv{self.k}n{i}"

    def dnat_rule(self) -> list[str]:
        return ["PREROUTING", "-i", self.bridge, "-d", self.host_ip, "-p", "tcp", "--dport",
                str(self.apiserver_port), "-j", "DNAT", "--to-destination", f"127.0.0.1:{self.apiserver_port}",
                "-m", "comment", "--comment", f"gpupool dev-cluster {self.bridge}"]

    @property
    def server(self) -> str:
        return f"https://{self.host_ip}:{self.apiserver_port}"


@contextlib.contextmanager
def _net_lock() -> Iterator[None]:
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    with (RUN_ROOT / "net.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _bridges() -> set[str]:
    done = sh("ip", "-j", "link", "show", "type", "bridge")
    return {link["ifname"] for link in json.loads(done.stdout or "[]")}


def ensure_cluster_net(cluster: str, apiserver_port: int, k: int | None = None) -> ClusterNet:
    """The cluster's bridge with its address and the DNAT to the apiserver (made if missing). `k`: the
    index recorded by an earlier call, else a free one (first probe from the cluster's name)."""
    with _net_lock():
        existing = _bridges()
        if k is None:
            start = zlib.crc32(cluster.encode()) % 254
            used = {int(name[4:]) for name in existing if name.startswith("gpbr") and name[4:].isdigit()}
            free = [(start + step) % 254 + 1 for step in range(254) if (start + step) % 254 + 1 not in used]
            if not free:
                raise DevClusterError("no free node network: 254 dev clusters with real nodes are up")
            k = free[0]
        net = ClusterNet(k, apiserver_port)
        if net.bridge not in existing:
            sh("ip", "link", "add", net.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{net.host_ip}/24", "dev", net.bridge)
            sh("ip", "link", "set", net.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{net.bridge}/route_localnet").write_text("1")
        if sh("iptables", "-t", "nat", "-C", *net.dnat_rule(), check=False).returncode != 0:
            sh("iptables", "-t", "nat", "-A", *net.dnat_rule())
        return net


def route_services(net: ClusterNet, service_cidr: str, nodes: int) -> None:
    """Send the host's traffic to Service ClusterIPs through node 0, whose kube-proxy translates it (as a
    control-plane node's own kube-proxy would): kube-scheduler calls an extender's Service this way. Pod
    IPs are routed to their node, as a cluster network does (headless Services, metrics scrapes)."""
    with _net_lock():
        sh("ip", "route", "replace", service_cidr, "via", net.node_ip(0), "dev", net.bridge)
        for i in range(nodes):
            sh("ip", "route", "replace", net.pod_cidr(i), "via", net.node_ip(i), "dev", net.bridge)


def remove_cluster_net(net: ClusterNet) -> None:
    with _net_lock():
        routes = sh("ip", "-4", "route", "show", "dev", net.bridge, check=False).stdout
        for line in routes.splitlines():
            if " via " in line:
                sh("ip", "route", "del", line.split()[0], "dev", net.bridge, check=False)
        while sh("iptables", "-t", "nat", "-D", *net.dnat_rule(), check=False).returncode == 0:
            pass
        if net.bridge in _bridges():
            sh("ip", "link", "del", net.bridge)


def netns_name(cluster: str, i: int) -> str:
    return f"gpupool-{cluster}-node-{i}"


def add_node_netns(net: ClusterNet, cluster: str, i: int) -> str:
    """The node's network namespace, wired to the bridge: eth0 with its node IP, default route to the host,
    forwarding on (pods are routed through it). Returns its name. A leftover one is the caller's to remove
    first (RealNode.teardown)."""
    if not 0 <= i < MAX_NODES:
        raise DevClusterError(f"node index {i} out of range 0..{MAX_NODES - 1}")
    ns = netns_name(cluster, i)
    sh("ip", "netns", "add", ns)
    veth = net.veth(i)
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", veth, "master", net.bridge, "up")
    sh("ip", "link", "set", "lo", "up", netns=ns)
    sh("ip", "addr", "add", f"{net.node_ip(i)}/24", "dev", "eth0", netns=ns)
    sh("ip", "link", "set", "eth0", "up", netns=ns)
    sh("ip", "route", "add", "default", "via", net.host_ip, netns=ns)
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1", netns=ns)
    return ns


def remove_node_netns(net: ClusterNet, cluster: str, i: int) -> None:
    ns = netns_name(cluster, i)
    if (NETNS_DIR / ns).exists():
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", net.veth(i), check=False)  # normally gone with the namespace


def netns_inode(ns_path: Path) -> int | None:
    try:
        return ns_path.stat().st_ino
    except OSError:
        return None


def cni_config(net: ClusterNet, cluster: str, i: int) -> dict[str, object]:
    """The node's CNI network: a bridge with host-local IPAM on the node's pod range, masquerading what
    leaves it (pods reach the apiserver through the node), and portmap for hostPorts."""
    cidr = ipaddress.ip_network(net.pod_cidr(i))
    return {
        "cniVersion": "1.0.0",
        "name": netns_name(cluster, i),
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(cidr), "gateway": str(cidr.network_address + 1)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(RUN_ROOT / cluster / f"node-{i}" / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
