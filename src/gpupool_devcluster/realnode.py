"""Real nodes beside the kwok ones: a kubelet and kube-proxy of the pinned release, and containerd + runc
from Debian, each node in its own network namespace (nodenet.py) with its own folders and cgroup root.

Everything a node makes is found again by where it lives, never by name matching on the whole machine:
    <cluster folder>/nodes/node-<i>/   pod logs, containerd's root (images), configs, certificates
    /run/gpupool/<cluster>/node-<i>/   kubelet root-dir, containerd's socket and state (pod netns and
                                       rootfs mounts), runc's
    /sys/fs/cgroup/*/gpupool-<cluster>-node-<i>/   the kubelet's cgroup root (every pod and container)
    netns gpupool-<cluster>-node-<i>   the node's processes (and containerd's shims)
`teardown` kills what runs in those, unmounts what is mounted under them and deletes them; `leftovers`
says what is still there (the tests check it is nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpupool_devcluster import nodenet
from gpupool_devcluster.binaries import cache_root, pinned_version, repo_root
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.kubeconfig import api_client, write_cert_kubeconfig
from gpupool_devcluster.layout import ClusterLayout
from gpupool_devcluster.oci import import_image
from gpupool_devcluster.pki import issue_client_cert
from gpupool_devcluster.process import TrackedProcess, start

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CGROUP_FS = Path("/sys/fs/cgroup")
NODE_PROCESSES = ("kube-proxy", "kubelet", "containerd", "namespaces")  # stop order
# Paths the kubelet does not let us move (the device manager's socket folder is a constant of the
# device plugin API; container log links go to /var/log/containers): each node's mount namespace binds
# its own folder over them, so nodes never share one and nothing of a node lands on the host's.
KUBELET_ROOT = Path("/var/lib/kubelet")
CONTAINER_LOGS = Path("/var/log/containers")
MAX_PODS = 32
Log = Callable[[str], None]


def node_name(cluster: str, i: int) -> str:
    return f"{cluster}-node-{i}"


def node_binaries() -> tuple[Path, Path]:
    """kubelet and kube-proxy of the pinned release (`make cluster-bins` builds them)."""
    folder = cache_root() / "bin" / f"kubernetes-node-{pinned_version('kubernetes')}"
    if not (folder / ".complete").is_file():
        raise DevClusterError(f"not built: {folder}; run `make cluster-bins` (kubelet, kube-proxy)")
    return folder / "kubelet", folder / "kube-proxy"


def can_run_real_nodes() -> str | None:
    """Why this machine cannot run real nodes, or None when it can."""
    if os.geteuid() != 0:
        return "real nodes need root (network namespaces, cgroups, mounts)"
    for tool in ("containerd", "runc", "ip", "iptables", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: containerd runc iproute2 iptables util-linux)"
    if not Path("/usr/lib/cni/bridge").is_file():
        return "the CNI plugins are not installed (Debian: containernetworking-plugins)"
    return None


@dataclass(frozen=True)
class RealNode:
    cluster: str
    i: int
    layout: ClusterLayout

    @property
    def name(self) -> str:
        return node_name(self.cluster, self.i)

    @property
    def netns(self) -> str:
        return nodenet.netns_name(self.cluster, self.i)

    @property
    def root(self) -> Path:
        return self.layout.root / "nodes" / f"node-{self.i}"

    @property
    def run(self) -> Path:
        return nodenet.RUN_ROOT / self.cluster / f"node-{self.i}"

    @property
    def kubelet_dir(self) -> Path:
        """What the node sees as /var/lib/kubelet (the kubelet's root-dir), in /run: pod volumes live and
        die with the node."""
        return self.run / "kubelet"

    @property
    def socket(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        return f"gpupool-{self.cluster}-node-{self.i}"

    def process_name(self, component: str) -> str:
        return f"node-{self.i}-{component}"

    # ---------------------------------------------------------------- start

    def write_configs(self, net: nodenet.ClusterNet) -> None:
        pki = self.layout.pki
        certs = self.root / "pki"
        issue_client_cert(pki, certs / "kubelet.crt", certs / "kubelet.key",
                          user=f"system:node:{self.name}", groups=("system:nodes",))
        issue_client_cert(pki, certs / "kube-proxy.crt", certs / "kube-proxy.key", user="system:kube-proxy")
        for user in ("kubelet", "kube-proxy"):
            write_cert_kubeconfig(self.root / f"{user}.kubeconfig", server=net.server, ca_cert=pki.ca_cert,
                                  cert=certs / f"{user}.crt", key=certs / f"{user}.key", user=user,
                                  cluster_name=self.cluster, tls_server_name="kubernetes")
        (self.root / "cni").mkdir(parents=True, exist_ok=True)
        (self.root / "cni" / "10-gpupool.conflist").write_text(
            json.dumps(nodenet.cni_config(net, self.cluster, self.i), indent=2))
        (self.root / "containerd.toml").write_text(self._containerd_toml())
        (self.root / "kubelet.yaml").write_text(yaml.safe_dump(self._kubelet_config(net), sort_keys=False))
        (self.root / "kube-proxy.yaml").write_text(yaml.safe_dump(self._proxy_config(), sort_keys=False))

    def _containerd_toml(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{self.root / 'containerd'}"
state = "{self.run / 'containerd'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.run / 'containerd.sock.ttrpc'}"
[debug]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.root / 'containerd-opt'}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true  # this VM withholds CAP_SYS_RESOURCE: no score below our own
  disable_apparmor = true
  tolerate_missing_hugetlb_controller = true
  stream_server_address = "127.0.0.1"
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{self.run / 'runc'}"
[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{self.root / 'cni'}"
"""

    def _kubelet_config(self, net: nodenet.ClusterNet) -> dict[str, object]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": net.node_ip(self.i),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.layout.pki.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False,
            "podLogsDir": str(self.root / "pod-logs"),
            "maxPods": MAX_PODS,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,  # a dev VM's disk is shared: never delete our local images
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "5s",
            "resolvConf": "/etc/resolv.conf",
        }

    def _proxy_config(self) -> dict[str, object]:
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.root / "kube-proxy.kubeconfig")},
            "hostnameOverride": self.name,
            "mode": "iptables",
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # conntrack limits are the host's business: never write them
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }

    def start(self, net: nodenet.ClusterNet, images: list[Path], log: Log) -> None:
        """Namespace, configs, containerd (images imported), kubelet, kube-proxy; the caller waits for
        the Node to be Ready."""
        kubelet, kube_proxy = node_binaries()
        self.teardown(net)  # anything left by a crashed run
        self.root.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True)
        for controller in _cgroup_hierarchies():
            (controller / self.cgroup_root).mkdir(exist_ok=True)
        nodenet.add_node_netns(net, self.cluster, self.i)
        self.write_configs(net)
        holder = self._hold_namespaces()
        enter = ["nsenter", f"--target={holder.pid}", "--mount", "--net", "--"]
        log(f"{self.name}: containerd {_containerd_version()} in netns {self.netns} ({net.node_ip(self.i)})")
        self._spawn("containerd", [*enter, "containerd", "--config", str(self.root / "containerd.toml")])
        self._wait_socket()
        for archive in images:
            import_image(archive, str(self.socket))
        if PAUSE_IMAGE not in self.images():
            raise DevClusterError(f"{PAUSE_IMAGE} is not among the images imported into {self.name}'s containerd "
                                  "(build it with `make image`)")
        log(f"{self.name}: kubelet and kube-proxy {pinned_version('kubernetes')}")
        self._spawn("kubelet", [
            *enter, str(kubelet), f"--config={self.root / 'kubelet.yaml'}",
            f"--kubeconfig={self.root / 'kubelet.kubeconfig'}", f"--root-dir={KUBELET_ROOT}",
            f"--cert-dir={self.root / 'pki' / 'kubelet-serving'}", f"--hostname-override={self.name}",
            f"--node-ip={net.node_ip(self.i)}", "--node-labels=nvidia.com/gpu.present=true,gpupool.io/real-node=true",
            "--v=1",
        ])
        self._spawn("kube-proxy", [*enter, str(kube_proxy), f"--config={self.root / 'kube-proxy.yaml'}", "--v=1"])

    def _hold_namespaces(self) -> TrackedProcess:
        """A process that holds the node's mount namespace (a slave of the host's: the host's mounts show
        inside, the node's stay inside) in the node's network namespace, with the node's folders bound
        over KUBELET_ROOT and CONTAINER_LOGS. Every node process enters both; when the last one exits,
        the kernel drops every mount the node made."""
        logs = self.root / "container-logs"
        for folder in (self.kubelet_dir, logs, KUBELET_ROOT, CONTAINER_LOGS):
            folder.mkdir(parents=True, exist_ok=True)
        script = (f"mount --bind {self.kubelet_dir} {KUBELET_ROOT} && mount --bind {logs} {CONTAINER_LOGS} "
                  "&& echo ready && exec sleep infinity")
        holder = self._spawn("namespaces", ["nsenter", f"--net={nodenet.NETNS_DIR / self.netns}", "--", "unshare",
                                            "--mount", "--propagation", "slave", "--", "sh", "-c", script])
        deadline = time.monotonic() + 10
        while "ready" not in holder.log_tail(1):
            if not holder.alive() or time.monotonic() > deadline:
                raise DevClusterError(f"{self.name}: could not make its mount namespace:\n{holder.log_tail(5)}")
            time.sleep(0.02)
        return holder

    def _spawn(self, component: str, argv: list[str]) -> TrackedProcess:
        name = self.process_name(component)
        return start(name, argv, self.layout.pid_file(name), self.layout.log_file(name))

    def process(self, component: str) -> TrackedProcess | None:
        return TrackedProcess.load(self.layout.pid_file(self.process_name(component)))

    def restart_kubelet(self) -> None:
        """Stop the kubelet and start it again with the same command line (pods keep running)."""
        process = self.process("kubelet")
        if process is None:
            raise DevClusterError(f"{self.name} has no kubelet")
        argv = json.loads(process.pid_file.read_text())["argv"]
        process.stop()
        self._spawn("kubelet", argv)

    def _wait_socket(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.socket.exists() and _ctr(self.socket, "version").returncode == 0:
                return
            process = self.process("containerd")
            if process is None or not process.alive():
                break
            time.sleep(0.1)
        raise DevClusterError(f"{self.name}: containerd did not start; see "
                              f"{self.layout.log_file(self.process_name('containerd'))}")

    def images(self) -> set[str]:
        done = _ctr(self.socket, "images", "ls", "-q")
        return set(done.stdout.split()) if done.returncode == 0 else set()

    # ---------------------------------------------------------------- teardown

    def teardown(self, net: nodenet.ClusterNet | None) -> list[str]:
        """Stop the node and delete everything it made (see the module doc); says what it removed."""
        removed: list[str] = []
        for component in NODE_PROCESSES:
            process = self.process(component)
            if process is not None:
                if process.alive():
                    removed.append(f"process {process.name}")
                process.stop(grace_s=5)
        ns_inode = nodenet.netns_inode(nodenet.NETNS_DIR / self.netns)
        for pid in self._pids(ns_inode):
            _kill(pid)
            removed.append(f"pid {pid}")
        for mount in reversed(self._mounts()):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
            removed.append(f"mount {mount}")
        for folder in self.cgroups():
            _rmdir_cgroup(folder)
            removed.append(f"cgroup {folder}")
        if net is not None and (nodenet.NETNS_DIR / self.netns).exists():
            nodenet.remove_node_netns(net, self.cluster, self.i)
            removed.append(f"netns {self.netns}")
        shutil.rmtree(self.run, ignore_errors=True)
        for sub in ("containerd", "pod-logs"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        return removed

    def leftovers(self) -> list[str]:
        """What of this node is still on the machine: processes, mounts, cgroups, its netns."""
        found = [f"pid {pid}" for pid in self._pids(nodenet.netns_inode(nodenet.NETNS_DIR / self.netns))]
        found += [f"mount {m}" for m in self._mounts()]
        found += [f"cgroup {c}" for c in self.cgroups()]
        if (nodenet.NETNS_DIR / self.netns).exists():
            found.append(f"netns {self.netns}")
        return found

    def _pids(self, ns_inode: int | None) -> set[int]:
        """Processes in the node's netns (kubelet, containerd, its shims) or in its cgroup tree (pods)."""
        pids: set[int] = set()
        for folder in self.cgroups():
            for procs in folder.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        if ns_inode is not None:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        if os.stat(entry / "ns" / "net").st_ino == ns_inode:
                            pids.add(int(entry.name))
                    except OSError:
                        pass
        pids.discard(os.getpid())
        return pids

    def _mounts(self) -> list[str]:
        prefixes = (f"{self.root}/", f"{self.run}/")
        found = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefixes):
                found.append(point)
        return sorted(found, key=len)

    def cgroups(self) -> list[Path]:
        return [c / self.cgroup_root for c in _cgroup_hierarchies() if (c / self.cgroup_root).is_dir()]


def default_images() -> list[Path]:
    """The OCI archives `make image` wrote (gpupool, the pause and workload images)."""
    archives = sorted((repo_root() / "out" / "image").glob("*.oci.tar"))
    if not archives:
        raise DevClusterError("no images in out/image/: build them with `make image` (as root)")
    return archives


def publish_apiserver_endpoint(kubeconfig: Path, net: nodenet.ClusterNet) -> None:
    """The `kubernetes` Service's EndpointSlice: the address pods reach kube-apiserver at (the cluster's
    bridge, NATed to its loopback port). kube-apiserver's own endpoint reconciler is off (it advertises
    127.0.0.1, which a pod cannot reach), so this is its only endpoint."""
    from kubernetes import client

    body = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes",
                                "endpointslice.kubernetes.io/managed-by": "gpupool-dev-cluster"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [net.host_ip], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": net.apiserver_port, "protocol": "TCP"}],
    }
    api = api_client(kubeconfig, pool_size=1)
    try:
        discovery = client.DiscoveryV1Api(api)
        try:
            discovery.create_namespaced_endpoint_slice("default", body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            discovery.replace_namespaced_endpoint_slice("kubernetes", "default", body)
    finally:
        api.close()


def wait_node_ready(kubeconfig: Path, node: RealNode, timeout_s: float) -> None:
    from kubernetes import client

    api = api_client(kubeconfig, pool_size=1)
    deadline = time.monotonic() + timeout_s
    reason = "not registered"
    try:
        core = client.CoreV1Api(api)
        while time.monotonic() < deadline:
            kubelet = node.process("kubelet")
            if kubelet is None or not kubelet.alive():
                raise DevClusterError(f"{node.name}: the kubelet exited:\n{kubelet.log_tail(15) if kubelet else ''}")
            try:
                found = core.read_node(node.name)
                ready = [c for c in found.status.conditions or () if c.type == "Ready"]
                if ready and ready[0].status == "True":
                    return
                reason = f"{ready[0].reason}: {ready[0].message}" if ready else "no Ready condition yet"
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
            time.sleep(0.5)
    finally:
        api.close()
    raise DevClusterError(f"{node.name} not Ready within {timeout_s:.0f}s ({reason}); see "
                          f"{node.layout.log_file(node.process_name('kubelet'))}")


def _ctr(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctr", "--address", str(socket), "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, check=False, timeout=120)


def _containerd_version() -> str:
    done = subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.split()[2] if len(done.stdout.split()) > 2 else "?"


def _cgroup_hierarchies() -> list[Path]:
    if (CGROUP_FS / "cgroup.controllers").exists():  # v2: one tree
        return [CGROUP_FS]
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink())


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (OSError, IndexError):
            return
        time.sleep(0.02)


def _rmdir_cgroup(folder: Path) -> None:
    """rmdir the cgroup and its children, deepest first (a cgroup with tasks cannot go; they were killed)."""
    for attempt in range(50):
        children = sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        try:
            for child in children:
                child.rmdir()
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 49:
                raise DevClusterError(f"cannot remove cgroup {folder}: processes are left in it") from None
            time.sleep(0.1)
