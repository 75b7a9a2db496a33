"""What a node publishes for the scheduler: extended-resource capacity, GFD-style labels and the
versioned inventory annotation. Used by the running plugin (patching its Node) and by the dev cluster
(creating kwok nodes from a fake profile), through the same discovery path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from gpupool_common.idlepods import IDLE_PODS_ANNOTATION
from gpupool_common.inventory import INVENTORY_ANNOTATION, NodeInventory
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.discovery import discover
from gpupool_deviceplugin.nvml.session import open_fake
from gpupool_deviceplugin.resources import ResourceSpec, build_resources, sharing_of

LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MIG_CAPABLE = "nvidia.com/mig.capable"
LABEL_MIG_STRATEGY = "nvidia.com/mig.strategy"
LABEL_SHARING = "nvidia.com/gpu.sharing-strategy"
LABEL_UNIT = "gpupool.io/gpu-memory-unit-mib"
# Every label the plugin owns: a key here that the plugin no longer wants is removed from the Node.
OWNED_LABELS = (LABEL_PRODUCT, LABEL_MEMORY, LABEL_COUNT, LABEL_MIG_CAPABLE, LABEL_MIG_STRATEGY,
                LABEL_SHARING, LABEL_UNIT)
OWNED_ANNOTATIONS = (INVENTORY_ANNOTATION, IDLE_PODS_ANNOTATION)

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class NodePublication:
    capacity: dict[str, str]               # extended resources: number of kubelet devices each
    labels: dict[str, str]
    annotations: dict[str, str]
    host_capacity: dict[str, str] = field(default_factory=dict)  # cpu/memory/pods (fake nodes only)
    inventory: NodeInventory | None = None
    keep: frozenset[str] = frozenset()  # owned annotations left as the Node has them (not known yet)


def label_value(text: str) -> str:
    """A valid label value: GFD spells `NVIDIA H100 80GB HBM3` as `NVIDIA-H100-80GB-HBM3`."""
    value = _LABEL_VALUE_BAD.sub("-", text.strip())[:63]
    return value.strip("-_.")


def build_publication(inventory: NodeInventory, resources: list[ResourceSpec], config: PluginConfig,
                      host_capacity: dict[str, str] | None = None, idle_pods: str | None = None,
                      idle_pending: bool = False) -> NodePublication:
    """`idle_pods`: the idle-pods annotation (gpupool_common.idlepods), None while nothing is measured.
    `idle_pending`: the sampler runs but has not measured yet: the Node's annotation is left as it is until
    it has (a restart does not remove and re-add it); without a sampler it is removed."""
    inventory = inventory.model_copy(update={"sharing": sharing_of(resources, config)})
    labels: dict[str, str] = {}
    if inventory.gpus:
        first = inventory.gpus[0]
        labels[LABEL_PRODUCT] = label_value(first.product)
        labels[LABEL_MEMORY] = str(first.memory_mib)
        labels[LABEL_COUNT] = str(len(inventory.gpus))
        labels[LABEL_MIG_CAPABLE] = str(any(g.mig_capable for g in inventory.gpus)).lower()
        labels[LABEL_MIG_STRATEGY] = config.mig_strategy
        sharing = inventory.sharing
        if sharing is not None and sharing.memory_unit_mib:
            labels[LABEL_SHARING] = "mps" if sharing.mps else "time-slicing"
            labels[LABEL_UNIT] = str(sharing.memory_unit_mib)
        else:
            labels[LABEL_SHARING] = "none"
    return NodePublication(
        capacity={r.name: str(len(r.devices)) for r in resources},
        labels=labels,
        annotations={INVENTORY_ANNOTATION: inventory.to_annotation(),
                     **({IDLE_PODS_ANNOTATION: idle_pods} if idle_pods is not None else {})},
        host_capacity=dict(host_capacity or {}),
        inventory=inventory,
        keep=frozenset({IDLE_PODS_ANNOTATION}) if idle_pending and idle_pods is None else frozenset(),
    )


def node_publication_for_profile(profile: str | Path, config: PluginConfig | None = None, *,
                                 node_name: str | None = None, pod_identity: bool = True) -> NodePublication:
    """What the plugin would publish on a node with this fake profile (kwok nodes use this).

    `node_name` seeds the GPU/MIG UUIDs exactly as the plugin does when started with
    `--fake-nvml PROFILE --node-name NODE`, so a kwok node and a plugin for it agree on every ID.
    Memory units are included: a deployed plugin always has the API server; so is `pod_identity`, what a
    plugin with the kubelet's PodResources socket mounted (the Helm chart's default) publishes.
    """
    config = config or PluginConfig()
    session = open_fake(profile, seed=node_name)
    session.init()
    try:
        inventory = discover(session).model_copy(update={"pod_identity": pod_identity})
    finally:
        session.shutdown()
    host = session.lib.profile.host
    resources = build_resources(inventory, config, memory_units=True)
    return build_publication(inventory, resources, config,
                             host_capacity={"cpu": host.cpu, "memory": host.memory, "pods": host.pods})
