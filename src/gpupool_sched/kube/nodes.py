"""A Kubernetes Node (raw API JSON) as the placement core sees it: allocatable CPU/memory/pods, labels,
taints, cordon, and the GPUs of the device plugin's `gpupool.io/gpu-inventory` annotation.

GPU model names are the inventory's product names spelled as GPU Feature Discovery spells its label
(`NVIDIA H100 80GB HBM3` -> `NVIDIA-H100-80GB-HBM3`); the `gpupool.io/gpu-model` pod annotation is
matched against these (kube/podspec.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from gpupool_common.inventory import INVENTORY_ANNOTATION, InventoryError, NodeInventory, parse_inventory
from gpupool_sched.model.cluster import GpuSpec, MigSlice, NodeSpec
from gpupool_sched.model.constraints import Taint

_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")
MIB = 1024 * 1024


def model_name(product: str) -> str:
    """The GPU model as scheduling names it: the product as a label value."""
    return _NOT_LABEL.sub("-", product.strip())[:63].strip("-_.")


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node: its placement spec plus what the scheduler needs to report about it."""

    spec: NodeSpec
    inventory: NodeInventory | None
    problem: str | None  # why the inventory could not be used (the node then offers no GPUs)
    unit_mib: int | None  # the node's nvidia.com/gpu-memory unit (None: not offered)
    memory_shares: bool  # memory units offered in the scheduler's unit size

    @property
    def name(self) -> str:
        return self.spec.name

    def gpu_uuid_index(self) -> dict[str, int]:
        return {g.uuid: g.index for g in self.spec.gpus}


def _quantity(value: Any, unit: int, default: int, *, milli: bool = False) -> int:
    """A node quantity in whole `unit`s (rounded down), or in thousandths with `milli`."""
    if value is None:
        return default
    try:
        amount = parse_quantity(str(value))
    except (ValueError, ArithmeticError):
        return default
    return int(amount * 1000 if milli else amount // unit)


def node_view(obj: Mapping[str, Any], memory_unit_mib: int) -> NodeView:
    """Build the view; a missing or unreadable inventory leaves the node without GPUs (CPU pods only)
    and says why in `problem`. GPUs the plugin reports as failed are dropped from scheduling."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    name = str(meta.get("name", ""))
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    taints = tuple(
        Taint(str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "NoSchedule")))
        for t in spec.get("taints") or ()
        if isinstance(t, Mapping)
    )
    inventory: NodeInventory | None = None
    problem: str | None = None
    raw = (meta.get("annotations") or {}).get(INVENTORY_ANNOTATION)
    if raw is not None:
        try:
            inventory = parse_inventory(raw)
        except (InventoryError, ValueError) as exc:
            problem = f"{INVENTORY_ANNOTATION} unusable: {str(exc).splitlines()[0]}"
    gpus: tuple[GpuSpec, ...] = ()
    unit_mib: int | None = None
    shares = False
    topology = None
    if inventory is not None:
        sharing = inventory.sharing
        unit_mib = sharing.memory_unit_mib if sharing is not None else None
        shares = unit_mib == memory_unit_mib
        failed = set(getattr(inventory, "unhealthy", ()) or ())
        unregistered = _not_allocatable_yet(alloc, sharing.resources if sharing is not None else {})
        if unregistered and inventory.gpus:
            problem = (f"the kubelet reports 0 allocatable {unregistered} (the device plugin is not registered "
                       "with it, e.g. after a kubelet restart)")
        gpus = tuple(_gpu_spec(g, memory_unit_mib if shares else None, g.uuid in failed, ready=not unregistered)
                     for g in inventory.gpus)
        if inventory.gpus:
            topology = inventory.topology()
    node = NodeSpec(
        name=name,
        cpu_milli=_quantity(alloc.get("cpu"), 1, 0, milli=True),
        memory_mib=_quantity(alloc.get("memory"), MIB, 0),
        gpus=gpus,
        max_pods=_quantity(alloc.get("pods"), 1, 110),
        labels=labels,
        topology=topology,
        taints=taints,
        unschedulable=bool(spec.get("unschedulable")),
    )
    return NodeView(node, inventory, problem, unit_mib, shares)


def _not_allocatable_yet(alloc: Mapping[str, Any], advertised: Mapping[str, int]) -> str | None:
    """A GPU resource the plugin advertises that the kubelet reports as 0 allocatable (as it does from its
    restart until the plugin registers again); None when there is none. A resource the node does not
    list at all is left to the inventory (fake nodes and older kubelets publish no such entry)."""
    for resource, count in advertised.items():
        if count > 0 and str(alloc.get(resource, "")).strip() == "0":
            return resource
    return None


def _gpu_spec(gpu: Any, unit_mib: int | None, failed: bool, *, ready: bool = True) -> GpuSpec:
    """`failed`: the plugin reports the GPU broken (it offers nothing). Not `ready`: the kubelet cannot
    allocate it yet; it takes no pod now but still counts among what the cluster offers (a pod asking
    for it is waiting, not impossible)."""
    # Memory shares are counted in whole units of the plugin: a GPU offers floor(MiB / unit) units.
    memory = (gpu.memory_mib // unit_mib) * unit_mib if unit_mib else 0
    slices = tuple(MigSlice(d.uuid, d.profile, gpu.index) for d in gpu.mig_devices) if gpu.mig_enabled else ()
    return GpuSpec(
        index=gpu.index,
        model=model_name(gpu.product),
        memory_mib=0 if failed else memory,
        uuid=gpu.uuid,
        numa_node=gpu.numa_node,
        mig_enabled=gpu.mig_enabled,
        mig_slices=slices,
        healthy=ready and not failed,
    )
