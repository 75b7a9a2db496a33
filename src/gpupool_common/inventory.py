"""The node GPU inventory: the versioned schema the device plugin publishes and the scheduler parses.

Published as JSON in the Node annotation `gpupool.io/gpu-inventory`. Version 1. Adding optional
fields keeps version 1; renaming, removing or changing the meaning of a field bumps the version,
and readers reject versions they do not know (`parse_inventory`).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpupool_common.topology import NodeTopology, PcieLevel

INVENTORY_ANNOTATION = "gpupool.io/gpu-inventory"
INVENTORY_VERSION: Final = 1

PcieLevelName = Literal["INTERNAL", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM"]
MigStrategy = Literal["none", "single", "mixed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # readers tolerate newer optional fields


class MigDevice(_Model):
    uuid: str
    profile: str = Field(description="MIG profile name, e.g. 1g.10gb or 1c.3g.40gb")
    gpu_instance_id: int
    compute_instance_id: int
    memory_mib: int
    placement_start: int | None = None
    placement_size: int | None = None


class Gpu(_Model):
    index: int
    uuid: str
    product: str
    memory_mib: int
    pci_bus_id: str
    numa_node: int | None
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()


class GpuPair(_Model):
    """Interconnect between GPUs a < b (by index)."""

    a: int
    b: int
    nvlinks: int = 0
    pcie: PcieLevelName


class Sharing(_Model):
    """How the plugin exposes the GPUs (depends on its config, not only on the hardware)."""

    mig_strategy: MigStrategy
    memory_unit_mib: int | None = Field(description="MiB per nvidia.com/gpu-memory device; None: not offered")
    mps: bool = False
    resources: dict[str, int] = Field(default_factory=dict, description="resource name -> device count")


class NodeInventory(_Model):
    version: Literal[1] = INVENTORY_VERSION
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    gpus: tuple[Gpu, ...]
    pairs: tuple[GpuPair, ...] = ()
    sharing: Sharing | None = None
    # UUIDs of GPUs and MIG devices with a hardware fault right now (Xid, ECC); the scheduler places
    # nothing on them. Optional: older plugins leave it out.
    unhealthy: tuple[str, ...] = ()
    # True while the plugin reads the kubelet's PodResources API and so knows which pod each allocation
    # is for: same-shape pods may then be pending on the node together, and the scheduler does not hold
    # its per-(node, shape) gate there (docs/handshake.md, rule 4). Optional: older plugins leave it out.
    pod_identity: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> NodeInventory:
        if [g.index for g in self.gpus] != list(range(len(self.gpus))):
            raise ValueError("gpus must be listed by index 0..n-1")
        n = len(self.gpus)
        for p in self.pairs:
            if not (0 <= p.a < p.b < n):
                raise ValueError(f"pair ({p.a}, {p.b}) is not a < b < {n}")
        return self

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def topology(self) -> NodeTopology:
        return NodeTopology.from_links(
            [g.numa_node for g in self.gpus],
            [(p.a, p.b, p.nvlinks, PcieLevel[p.pcie]) for p in self.pairs],
        )

    def to_annotation(self) -> str:
        """Compact JSON, stable key order, so equal inventories give equal strings."""
        return self.model_dump_json(exclude_none=False)


class InventoryError(ValueError):
    pass


def parse_inventory(text: str) -> NodeInventory:
    """Parse the annotation value; unknown versions are an error, not a guess."""
    import json

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InventoryError(f"{INVENTORY_ANNOTATION} is not JSON: {exc}") from None
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != INVENTORY_VERSION:
        raise InventoryError(f"{INVENTORY_ANNOTATION} version {version!r} is not supported (want {INVENTORY_VERSION})")
    return NodeInventory.model_validate(raw)
