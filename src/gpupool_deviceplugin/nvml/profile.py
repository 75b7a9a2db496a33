"""Fake node descriptions ("profiles"): the hardware the fake NVML backend pretends to be.

A profile is YAML validated by `FakeProfile`. The same profile drives the fake NVML backend of the
device plugin, the kwok nodes of the dev cluster and the simulator's node shapes, so there is one
description of each fake machine. Shipped profiles live in `profiles/` and are addressed by name
(`dgx-h100`); any other YAML file can be addressed by path.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import pynvml
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILE_PACKAGE = "gpupool_deviceplugin.nvml.profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSpec(_Strict):
    """What the machine offers besides GPUs (Kubernetes quantities, used for kwok nodes)."""

    cpu: str
    memory: str
    pods: str = "110"


class GpuDefaults(_Strict):
    product: str
    memory_mib: int = Field(gt=0)


class MigProfileSpec(_Strict):
    """One MIG profile of this product, as NVML describes it."""

    variant: int = Field(ge=0, description="NVML_GPU_INSTANCE_PROFILE_* enum value")
    profile_id: int = Field(ge=0, description="the profile ID nvidia-smi mig -lgip shows")
    gpu_instance_slices: int = Field(gt=0)
    compute_instance_slices: int = Field(gt=0)
    memory_mib: int = Field(gt=0)
    placement_size: int = Field(gt=0)


class MigDeviceSpec(_Strict):
    profile: str
    placement: int = Field(ge=0)
    uuid: str | None = None


class GpuSpec(_Strict):
    index: int = Field(ge=0)
    pci_bus_id: str = Field(pattern=r"^[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
    numa_node: int | None = None
    pcie_switch: str | None = None
    upstream_switch: str | None = None
    host_bridge: str | None = None
    board: str | None = None
    product: str | None = None
    memory_mib: int | None = None
    uuid: str | None = None
    mig_enabled: bool | None = None
    mig: tuple[MigDeviceSpec, ...] = ()

    @property
    def mig_on(self) -> bool:
        return self.mig_enabled if self.mig_enabled is not None else bool(self.mig)


class NvSwitchSpec(_Strict):
    """All GPUs sit on one NVSwitch fabric with this many NVLinks each."""

    links_per_gpu: int = Field(gt=0)
    switches: int = Field(default=4, gt=0)


class NvLinkBridgeSpec(_Strict):
    gpus: tuple[int, int]
    links: int = Field(gt=0)


class NvmlBehaviour(_Strict):
    """Failure modes of the fake library itself (tests of start-up retries)."""

    init_failures: int = Field(default=0, ge=0)
    init_error: Literal["DRIVER_NOT_LOADED", "LIBRARY_NOT_FOUND", "NO_PERMISSION", "UNKNOWN"] = "DRIVER_NOT_LOADED"


class FakeProfile(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    description: str = ""
    host: HostSpec
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040
    mig_capable: bool = False
    defaults: GpuDefaults
    gpus: tuple[GpuSpec, ...] = Field(min_length=1)
    nvswitch: NvSwitchSpec | None = None
    nvlink_bridges: tuple[NvLinkBridgeSpec, ...] = ()
    mig_profiles: dict[str, MigProfileSpec] = Field(default_factory=dict)
    nvml: NvmlBehaviour = NvmlBehaviour()

    @model_validator(mode="after")
    def _consistent(self) -> FakeProfile:
        indices = [g.index for g in self.gpus]
        if indices != list(range(len(self.gpus))):
            raise ValueError(f"gpus: indices must be 0..{len(self.gpus) - 1} in order, got {indices}")
        buses = [g.pci_bus_id.upper() for g in self.gpus]
        if len(set(buses)) != len(buses):
            raise ValueError("gpus: pci_bus_id values must be unique")
        for bridge in self.nvlink_bridges:
            a, b = bridge.gpus
            if a == b or not (0 <= a < len(self.gpus) and 0 <= b < len(self.gpus)):
                raise ValueError(f"nvlink_bridges: bad GPU pair {bridge.gpus}")
        if self.nvswitch and self.nvlink_bridges:
            raise ValueError("a profile has either nvswitch or nvlink_bridges, not both")
        for gpu in self.gpus:
            if gpu.mig_on and not self.mig_capable:
                raise ValueError(f"gpus[{gpu.index}]: MIG enabled but the profile is not mig_capable")
            used: set[int] = set()
            for k, dev in enumerate(gpu.mig):
                spec = self.mig_profiles.get(dev.profile)
                if spec is None:
                    raise ValueError(f"gpus[{gpu.index}].mig[{k}]: unknown MIG profile {dev.profile!r}")
                slots = set(range(dev.placement, dev.placement + spec.placement_size))
                if slots & used or max(slots) > 7:
                    raise ValueError(f"gpus[{gpu.index}].mig[{k}]: placement {dev.placement} overlaps or overflows")
                used |= slots
        return self

    def gpu_product(self, index: int) -> str:
        return self.gpus[index].product or self.defaults.product

    def gpu_memory_mib(self, index: int) -> int:
        return self.gpus[index].memory_mib or self.defaults.memory_mib

    def nvlinks_between(self, a: int, b: int) -> int:
        """NVLinks joining GPU a and GPU b (through the NVSwitch fabric or a bridge)."""
        if a == b:
            return 0
        if self.nvswitch:
            return self.nvswitch.links_per_gpu
        return sum(br.links for br in self.nvlink_bridges if set(br.gpus) == {a, b})

    def links_of(self, index: int) -> int:
        if self.nvswitch:
            return self.nvswitch.links_per_gpu
        return sum(br.links for br in self.nvlink_bridges if index in br.gpus)

    def pcie_level(self, a: int, b: int) -> int:
        """NVML topology level (NVML_TOPOLOGY_*) of the closest common PCIe ancestor of a and b."""
        ga, gb = self.gpus[a], self.gpus[b]
        if a == b or (ga.board is not None and ga.board == gb.board):
            return pynvml.NVML_TOPOLOGY_INTERNAL
        if ga.pcie_switch is not None and ga.pcie_switch == gb.pcie_switch:
            return pynvml.NVML_TOPOLOGY_SINGLE
        if ga.upstream_switch is not None and ga.upstream_switch == gb.upstream_switch:
            return pynvml.NVML_TOPOLOGY_MULTIPLE
        if ga.host_bridge is not None and ga.host_bridge == gb.host_bridge:
            return pynvml.NVML_TOPOLOGY_HOSTBRIDGE
        if ga.numa_node is not None and ga.numa_node == gb.numa_node:
            return pynvml.NVML_TOPOLOGY_NODE
        return pynvml.NVML_TOPOLOGY_SYSTEM


class ProfileError(ValueError):
    """A profile that does not exist or does not validate; the message names the problem."""


def profile_names() -> list[str]:
    """Names of the profiles shipped with gpupool."""
    root = resources.files(PROFILE_PACKAGE)
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path) -> FakeProfile:
    """A shipped profile by name (`dgx-h100`) or any profile YAML by path."""
    text, origin = _profile_text(str(name_or_path))
    return _parse(text, origin)


@cache
def _parse(text: str, origin: str) -> FakeProfile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{origin}: not valid YAML: {exc}") from None
    try:
        return FakeProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ProfileError(f"{origin}: {where}: {first['msg']}") from None


def _profile_text(name_or_path: str) -> tuple[str, str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ProfileError(f"fake NVML profile file {path} does not exist")
        return path.read_text(), str(path)
    shipped = resources.files(PROFILE_PACKAGE) / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise ProfileError(f"unknown fake NVML profile {name_or_path!r}; shipped: {', '.join(profile_names())}")
    return shipped.read_text(), f"profile {name_or_path}"
