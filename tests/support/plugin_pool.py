"""Nodes that run the real device plugin (`gpupool-deviceplugin --fake-nvml l40s-pcie`, a process) behind
the kubelet stand-in, each with its `NodeKubelet` admitting the pods bound to it: the nodes of the full-path
e2e tests (scheduler -> Binding -> plugin -> kubelet admission -> ack -> the scheduler's gate), and of the
demo's node agent. They are NOT kwok nodes: kwok would mark their pods Running at once.

`plugin_pool(...)` makes `count` such nodes labelled with one pool and removes them afterwards.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_nodes import fake_node_manifest, publication_for_profile
from gpupool_devcluster.raw import discard
from tests.support.kubelet_standin import KubeletStandin
from tests.support.node_kubelet import GPU, MEM, NodeKubelet, PodLife
from tests.support.plugin_process import PluginProcess
from tests.support.scheduler_harness import POOL_LABEL, unique, wait_until

__all__ = ["GPU", "MEM", "NODES", "PROFILE", "PluginNode", "Pool", "create_node", "plugin_pool"]

PROFILE = "l40s-pcie"  # 4 GPUs, 44 units of 1 GiB each, no MIG
NODES = 2


@dataclass
class PluginNode:
    name: str
    plugin: PluginProcess
    standin: KubeletStandin
    kubelet: NodeKubelet


@dataclass
class Pool:
    name: str
    nodes: dict[str, PluginNode]

    def kubelets(self) -> list[NodeKubelet]:
        return [n.kubelet for n in self.nodes.values()]

    def life(self, key: str) -> PodLife:
        found = [p for k in self.kubelets() for p in k.lives() if p.key == key]
        assert len(found) == 1, f"{key}: seen by {len(found)} kubelets"
        return found[0]

    def wait_acked(self, keys: set[str], timeout_s: float = 30.0) -> None:
        """Every pod bound to a plugin node, admitted without error and acknowledged by the plugin."""
        def seen() -> dict[str, PodLife]:
            return {p.key: p for k in self.kubelets() for p in k.lives() if p.key in keys}

        def done() -> bool:
            lives = seen()
            return any(p.error for p in lives.values()) or (
                set(lives) == keys and all(p.ack_rv is not None for p in lives.values()))

        try:
            wait_until(done, timeout_s, "every pod acknowledged", interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the kubelets saw {seen()}") from None
        errors = {k: p.error for k, p in seen().items() if p.error}
        assert not errors, f"admission refused: {errors}"


def create_node(kube: ClusterClient, name: str, pool: str, pod_identity: bool) -> None:
    """The Node a kubelet + our plugin would register, without kwok's annotation."""
    published = publication_for_profile(PROFILE, node_name=name, pod_identity=pod_identity)
    body = fake_node_manifest(name, PROFILE, published)
    body["metadata"]["annotations"].pop("kwok.x-k8s.io/node")
    body["metadata"]["labels"][POOL_LABEL] = pool
    discard(kube.core.create_node(body=body, _preload_content=False))


@contextlib.contextmanager
def plugin_pool(
    kube: ClusterClient, work: Path, prefix: str, *, pod_resources: bool, count: int = NODES,
    kubelet: Callable[[ClusterClient, str, KubeletStandin], NodeKubelet] = NodeKubelet,
    plugin_env: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> Iterator[Pool]:
    """`count` nodes `<prefix>-<random>-n<i>` of the pool of that name, each with a kubelet stand-in (serving
    PodResources where `pod_resources`: the plugin then knows pod identity and publishes it), a plugin
    process writing under `work` (started inside `plugin_env()`, e.g. an environment of its own) and a
    kubelet made by `kubelet(kube, node, standin)`; all registered and healthy before it is yielded."""
    name = unique(prefix)
    nodes: dict[str, PluginNode] = {}
    dirs: list[tempfile.TemporaryDirectory[str]] = []
    created: list[str] = []
    try:
        for i in range(count):
            node = f"{name}-n{i}"
            create_node(kube, node, name, pod_identity=pod_resources)
            created.append(node)
            d = tempfile.TemporaryDirectory(prefix="gpk-")  # unix socket paths: keep it short
            dirs.append(d)
            kubelet_dir = Path(d.name) / "device-plugins"  # PodResources beside it: <d>/pod-resources
            kubelet_dir.mkdir()
            standin = KubeletStandin(kubelet_dir, pod_resources=pod_resources)
            standin.start()
            with plugin_env():
                plugin = PluginProcess(work, kubelet_dir, PROFILE, node=node, kubeconfig=kube.kubeconfig).start()
            nodes[node] = PluginNode(node, plugin, standin, kubelet(kube, node, standin))
        for n in nodes.values():
            n.standin.wait_registered({GPU, MEM}, timeout=30)
            n.plugin.wait_healthz(200, timeout=30)
            n.kubelet.start()
        yield Pool(name, nodes)
    finally:
        for n in nodes.values():
            n.kubelet.stop()
            n.plugin.stop()
            n.standin.stop()
        for d in dirs:
            d.cleanup()
        for node in created:
            try:
                discard(kube.core.delete_node(node, _preload_content=False))
            except ApiException as exc:
                if exc.status != 404:
                    raise
