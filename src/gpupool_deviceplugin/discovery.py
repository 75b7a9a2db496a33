"""Discovery: what NVML says about this node, as a `NodeInventory` (without the sharing section)."""

from __future__ import annotations

import logging
from collections import Counter
from itertools import combinations
from typing import cast

import pynvml

from gpupool_common.inventory import Gpu, GpuPair, MigDevice, NodeInventory, PcieLevelName
from gpupool_common.topology import PcieLevel
from gpupool_deviceplugin.nvml.session import MigInfo, NvmlSession

log = logging.getLogger(__name__)

# GPU instance profile variants whose name carries a suffix (NVML_GPU_INSTANCE_PROFILE_*); the
# kubelet accepts no "+" in resource names, so "+me" is spelled ".me" as NVIDIA's plugin does.
_PROFILE_SUFFIX = {
    getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1", 0x7): ".me",
    getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME", 0xF): ".me.all",
    getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME", 0x10): ".me.all",
    getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME", 0xD): ".-me",
    getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME", 0xE): ".-me",
}


def mig_profile_name(gi_slices: int, ci_slices: int, mig_memory_mib: int, gpu_memory_mib: int) -> str:
    """`1g.10gb`-style name from NVML attributes.

    NVML reports a MIG device's memory a little below its nominal size (an A100 80GB 1g.10gb has
    9728 MiB), so the size is the device's share of the GPU rounded up to the next eighth of the
    GPU's nominal GB (every MIG-capable product slices memory in eighths or quarters).
    """
    total_gb = round(gpu_memory_mib / 1024)
    eighths = -(-mig_memory_mib * 8 // gpu_memory_mib)  # ceil
    gb = round(eighths * total_gb / 8)
    base = f"{gi_slices}g.{gb}gb"
    return base if ci_slices == gi_slices else f"{ci_slices}c.{base}"


def discover(session: NvmlSession) -> NodeInventory:
    """One pass over NVML. NVML must be initialised."""
    handles = session.gpu_handles()
    gpus: list[Gpu] = []
    bus_to_index: dict[str, int] = {}
    for index, handle in enumerate(handles):
        bus = session.pci_bus_id(handle)
        memory = session.memory_mib(handle)
        capable, enabled = session.mig_capable_and_enabled(handle)
        migs = tuple(_mig_device(m, memory) for m in session.mig_devices(handle)) if enabled else ()
        gpus.append(Gpu(
            index=index,
            uuid=session.uuid(handle),
            product=session.name(handle),
            memory_mib=memory,
            pci_bus_id=bus,
            numa_node=session.numa_node(bus),
            mig_capable=capable,
            mig_enabled=enabled,
            mig_devices=migs,
        ))
        bus_to_index[bus] = index
    return NodeInventory(
        driver_version=session.driver_version(),
        cuda_driver_version=session.cuda_driver_version(),
        gpus=tuple(gpus),
        pairs=tuple(_pairs(session, handles, gpus, bus_to_index)),
    )


def _mig_device(m: MigInfo, gpu_memory_mib: int) -> MigDevice:
    name = mig_profile_name(m.gpu_instance_slices, m.compute_instance_slices, m.memory_mib, gpu_memory_mib)
    return MigDevice(
        uuid=m.uuid,
        profile=name + _PROFILE_SUFFIX.get(m.profile_variant, "") if m.profile_variant is not None else name,
        gpu_instance_id=m.gpu_instance_id,
        compute_instance_id=m.compute_instance_id,
        memory_mib=m.memory_mib,
        placement_start=m.placement_start,
        placement_size=m.placement_size,
    )


def _pairs(session: NvmlSession, handles: list, gpus: list[Gpu], bus_to_index: dict[str, int]) -> list[GpuPair]:
    n = len(handles)
    direct: Counter[tuple[int, int]] = Counter()
    switch_links = [0] * n
    for i, handle in enumerate(handles):
        for end in session.nvlinks(handle):
            peer = bus_to_index.get(end.remote_bus_id)
            if end.remote_is_switch or (end.remote_is_switch is None and peer is None):
                switch_links[i] += 1
            elif peer is not None and peer != i:
                direct[(i, peer)] += 1
    pairs = []
    for a, b in combinations(range(n), 2):
        # both ends report the same bridge links: count them once
        links = max(direct[(a, b)], direct[(b, a)])
        if switch_links[a] and switch_links[b]:
            links += min(switch_links[a], switch_links[b])
        level = _level(session, handles, gpus, a, b).name  # PcieLevelName lists PcieLevel's names
        pairs.append(GpuPair(a=a, b=b, nvlinks=links, pcie=cast(PcieLevelName, level)))
    return pairs


def _level(session: NvmlSession, handles: list, gpus: list[Gpu], a: int, b: int) -> PcieLevel:
    try:
        return PcieLevel(session.topology_level(handles[a], handles[b]))
    except (pynvml.NVMLError_NotSupported, ValueError) as exc:
        log.warning("no PCIe topology for GPUs %d and %d (%s); guessing from NUMA", a, b, exc)
        na, nb = gpus[a].numa_node, gpus[b].numa_node
        return PcieLevel.NODE if na is not None and na == nb else PcieLevel.SYSTEM
