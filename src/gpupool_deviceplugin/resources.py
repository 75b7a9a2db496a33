"""Which extended resources a node offers and the kubelet devices of each, from inventory + config.

Three kinds can live side by side on one node:
  gpu     nvidia.com/gpu           one device per whole GPU (ID = GPU UUID); with migStrategy=single,
                                   one per MIG device instead (ID = MIG UUID)
  mig     nvidia.com/mig-<profile> one device per MIG device (migStrategy=mixed)
  memory  nvidia.com/gpu-memory    one device per memory unit of each shareable GPU (ID = <uuid>::<k>)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from gpupool_common.inventory import NodeInventory, Sharing
from gpupool_deviceplugin.config import PluginConfig

GPU_RESOURCE = "nvidia.com/gpu"
MEMORY_RESOURCE = "nvidia.com/gpu-memory"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
UNIT_SEPARATOR = "::"
ResourceKind = Literal["gpu", "mig", "memory"]


class StrategyError(ValueError):
    """The GPUs' MIG layout does not fit the configured migStrategy."""


@dataclass(frozen=True, slots=True)
class PluginDevice:
    id: str
    gpu_uuid: str          # the physical GPU this device lives on
    gpu_index: int
    numa_node: int | None
    mig_uuid: str | None = None
    unit: int | None = None  # memory unit number for gpu-memory devices


@dataclass(frozen=True)
class ResourceSpec:
    name: str
    kind: ResourceKind
    devices: tuple[PluginDevice, ...]

    @property
    def endpoint(self) -> str:
        """Socket file name in the kubelet's device-plugin directory."""
        return "gpupool-" + self.name.split("/", 1)[1] + ".sock"

    def by_id(self) -> dict[str, PluginDevice]:
        return {d.id: d for d in self.devices}


def memory_unit_id(gpu_uuid: str, unit: int) -> str:
    return f"{gpu_uuid}{UNIT_SEPARATOR}{unit}"


def split_memory_unit_id(device_id: str) -> tuple[str, int] | None:
    uuid, sep, unit = device_id.rpartition(UNIT_SEPARATOR)
    if not sep or not unit.isdigit():
        return None
    return uuid, int(unit)


def build_resources(inventory: NodeInventory, config: PluginConfig, *, memory_units: bool) -> list[ResourceSpec]:
    """The resources to serve. `memory_units` False drops nvidia.com/gpu-memory (no API server)."""
    strategy = config.mig_strategy
    mig_gpus = [g for g in inventory.gpus if g.mig_enabled]
    whole_gpus = [g for g in inventory.gpus if not g.mig_enabled or strategy == "none"]
    out: list[ResourceSpec] = []

    if config.resources.gpu:
        if strategy == "single" and mig_gpus:
            out.append(ResourceSpec(GPU_RESOURCE, "mig", _single_strategy_devices(inventory)))
        else:
            devs = tuple(PluginDevice(g.uuid, g.uuid, g.index, g.numa_node) for g in whole_gpus)
            if devs:
                out.append(ResourceSpec(GPU_RESOURCE, "gpu", devs))

    if config.resources.mig and strategy == "mixed":
        by_profile: dict[str, list[PluginDevice]] = {}
        for g in mig_gpus:
            for m in g.mig_devices:
                by_profile.setdefault(m.profile, []).append(
                    PluginDevice(m.uuid, g.uuid, g.index, g.numa_node, mig_uuid=m.uuid))
        for profile in sorted(by_profile):
            out.append(ResourceSpec(MIG_RESOURCE_PREFIX + profile, "mig", tuple(by_profile[profile])))

    if config.resources.gpu_memory and memory_units:
        unit = config.gpu_memory.unit_mib
        devs = tuple(
            PluginDevice(memory_unit_id(g.uuid, k), g.uuid, g.index, g.numa_node, unit=k)
            for g in inventory.gpus if not g.mig_enabled
            for k in range(g.memory_mib // unit)
        )
        if devs:
            out.append(ResourceSpec(MEMORY_RESOURCE, "memory", devs))
    return out


def _single_strategy_devices(inventory: NodeInventory) -> tuple[PluginDevice, ...]:
    """migStrategy=single: every GPU in MIG mode with one profile, advertised as nvidia.com/gpu."""
    whole = [g.index for g in inventory.gpus if not g.mig_enabled]
    if whole:
        raise StrategyError(f"migStrategy=single needs MIG enabled on every GPU, GPUs {whole} have it off "
                            "(use migStrategy=mixed)")
    profiles = Counter(m.profile for g in inventory.gpus for m in g.mig_devices)
    if len(profiles) > 1:
        raise StrategyError(f"migStrategy=single needs one MIG profile on the node, found {dict(profiles)} "
                            "(use migStrategy=mixed)")
    return tuple(PluginDevice(m.uuid, g.uuid, g.index, g.numa_node, mig_uuid=m.uuid)
                 for g in inventory.gpus for m in g.mig_devices)


def sharing_of(resources: list[ResourceSpec], config: PluginConfig) -> Sharing:
    has_memory = any(r.kind == "memory" for r in resources)
    return Sharing(
        mig_strategy=config.mig_strategy,
        memory_unit_mib=config.gpu_memory.unit_mib if has_memory else None,
        mps=config.gpu_memory.mps if has_memory else False,
        resources={r.name: len(r.devices) for r in resources},
    )
