"""Where one named dev cluster keeps its files, and the record of a running one (state.json).

<cache>/dev-cluster/<name>/
    kubeconfig              admin kubeconfig (token of a system:masters user), printed by `up`
    kubeconfigs/<user>.yaml one per component (kube-scheduler, kube-controller-manager, kwok)
    pki/                    CA, apiserver serving cert, service-account keys, token file
    run/<component>.pid     pid + start time of each process
    logs/<component>.log    its output
    state.json              ports, versions, etcd data dir
etcd's data lives in a temp dir (in /dev/shm when there is one) named in state.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpupool_devcluster.binaries import cache_root
from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.pki import ClusterPki

DEFAULT_CLUSTER = "default"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


@dataclass(frozen=True)
class ClusterLayout:
    name: str
    root: Path

    @classmethod
    def for_name(cls, name: str) -> ClusterLayout:
        if not _NAME.match(name):
            raise DevClusterError(f"bad cluster name {name!r}: use 1-40 lowercase letters, digits and '-'")
        return cls(name, cache_root() / "dev-cluster" / name)

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def component_kubeconfig(self, component: str) -> Path:
        return self.root / "kubeconfigs" / f"{component}.yaml"

    @property
    def pki(self) -> ClusterPki:
        return ClusterPki(self.root / "pki")

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def pid_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.pid"

    def log_file(self, component: str) -> Path:
        return self.root / "logs" / f"{component}.log"

    def config_file(self, component: str, suffix: str = ".yaml") -> Path:
        return self.root / "config" / f"{component}{suffix}"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"


@dataclass
class ClusterState:
    """What `up` started, kept in state.json so later commands and other processes find the cluster."""

    name: str
    server: str
    etcd_url: str
    etcd_data_dir: str
    kubernetes_version: str
    kwok_version: str
    started_at: float
    ports: dict[str, int] = field(default_factory=dict)
    node_net: int = 0  # index of the real nodes' network (nodenet.ClusterNet.k), 0: none made
    real_nodes: int = 0  # how many real nodes (kubelet + containerd) run

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ClusterState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            raise DevClusterError(f"{path} is unreadable; run `gpupool dev-cluster down` to reset") from None
