"""One fake node's pods driven by hand through the assignment handshake, for the device plugin's e2e tests:
created unscheduled, bound with an assignment in the Binding as the scheduler binds them (or without one, as
another scheduler does), and the plugin's ack read back."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from gpupool_common.handshake import parse_ack
from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_deviceplugin.resources import split_memory_unit_id
from tests.support.kubelet_standin import ContainerRequest
from tests.support.objects import assignment


class Cluster:
    """Pods for one fake node: create (unscheduled), bind with an assignment, read back."""

    def __init__(self, kube, namespace: str, node: str) -> None:
        self.core: client.CoreV1Api = kube.core
        self.ns = namespace
        self.node = node
        node_obj = self.core.read_node(node)
        self.inventory = parse_inventory(node_obj.metadata.annotations[INVENTORY_ANNOTATION])
        self.uuids = [g.uuid for g in self.inventory.gpus]

    def create(self, name: str, containers: list[ContainerRequest]) -> str:
        def spec(c: ContainerRequest) -> client.V1Container:
            limits = {k: str(v) for k, v in c.requests.items()}
            return client.V1Container(name=c.name, image="busybox", resources=client.V1ResourceRequirements(
                limits=limits), restart_policy="Always" if c.sidecar else None)

        pod = client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=client.V1PodSpec(
            scheduler_name="nobody",  # no scheduler picks it up; the test binds it
            containers=[spec(c) for c in containers if not c.init],
            init_containers=[spec(c) for c in containers if c.init] or None))
        return self.core.create_namespaced_pod(self.ns, pod).metadata.uid

    def bind(self, name: str, uid: str, containers: dict[str, dict[str, Any]] | None) -> None:
        """Bind with the assignment in the Binding's annotations, as the scheduler does (None: without one,
        as another scheduler does)."""
        annotations = assignment(self.node, uid, containers) if containers is not None else None
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, annotations=annotations),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=self.node))
        self.core.create_namespaced_binding(self.ns, body, _preload_content=False)

    def ack(self, name: str):
        return parse_ack(self.core.read_namespaced_pod(name, self.ns).metadata.annotations)


def gpu_of(units: list[str]) -> str:
    """The one GPU that memory units all belong to."""
    (gpu,) = {(split_memory_unit_id(u) or ("not a unit: " + u,))[0] for u in units}
    return gpu
