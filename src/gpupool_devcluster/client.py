"""A running dev cluster as tests, benchmarks and the CLI use it: its kubeconfig, a `kubernetes` client,
and fake GPU nodes made from device-plugin profiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from gpupool_devcluster import fake_nodes
from gpupool_devcluster.cluster import DevCluster
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.kubeconfig import api_client
from gpupool_devcluster.process import TrackedProcess

READY_TIMEOUT_S = 300.0


@dataclass
class ClusterClient:
    """Handle on a running dev cluster (the pytest fixture `kube` is one)."""

    cluster: DevCluster
    kubeconfig: Path
    server: str
    api_client: client.ApiClient
    core: client.CoreV1Api
    created_nodes: list[str] = field(default_factory=list)
    _schedulers: list[TrackedProcess] = field(default_factory=list)

    @classmethod
    def connect(cls, cluster: DevCluster, *, pool_size: int = 32) -> ClusterClient:
        state = cluster.require_running()
        api = api_client(cluster.kubeconfig, pool_size=pool_size)
        return cls(cluster, cluster.kubeconfig, state.server, api, client.CoreV1Api(api))

    def add_nodes(
        self,
        profile: str,
        count: int,
        prefix: str | None = None,
        *,
        wait: bool = True,
        timeout_s: float = READY_TIMEOUT_S,
        concurrency: int = 32,
        created: fake_nodes.Progress | None = None,
        ready: fake_nodes.Progress | None = None,
    ) -> list[str]:
        """Create `count` fake nodes of `profile` named `<prefix><index>` (indices continue after the
        highest one in use), then, with `wait`, block until all are Ready. Returns their names."""
        if count <= 0:
            raise DevClusterError(f"count must be at least 1, not {count}")
        fake_nodes.publication_for_profile(profile)  # unknown profile: fail before touching the cluster
        names = fake_nodes.next_free_names(self.core, prefix or f"kwok-{profile}-", count)
        try:
            fake_nodes.create_fake_nodes(self.core, profile, names, concurrency=concurrency, progress=created)
        finally:
            self.created_nodes.extend(names)  # a partial batch is still cleaned up by delete_nodes
        if wait:
            fake_nodes.wait_nodes_ready(self.core, names, timeout_s=timeout_s, progress=ready)
        return names

    def delete_nodes(self, names: list[str]) -> None:
        fake_nodes.delete_nodes(self.core, names)
        gone = set(names)
        self.created_nodes = [name for name in self.created_nodes if name not in gone]

    def start_kube_scheduler(
        self,
        scheduler_name: str = "default-scheduler",
        *,
        tag: str = "kube-scheduler",
        extra_config: dict[str, object] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> TrackedProcess:
        """The real kube-scheduler with one profile `scheduler_name`; stopped by `close()` or `down`."""
        process = self.cluster.start_kube_scheduler(scheduler_name=scheduler_name, tag=tag, extra_config=extra_config,
                                                    extra_args=extra_args)
        self._schedulers.append(process)
        return process

    def close(self) -> None:
        for process in self._schedulers:
            process.stop()
        self._schedulers.clear()
        self.api_client.close()
