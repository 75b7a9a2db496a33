"""NUMA node of a PCI device, as the kernel reports it in sysfs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

NumaReader = Callable[[str], int | None]


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's `00000000:18:00.0` (8-digit domain, upper case) -> sysfs's `0000:18:00.0`."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


class SysfsNuma:
    """Reads /sys/bus/pci/devices/<bus id>/numa_node; -1 (no NUMA) and missing files give None."""

    def __init__(self, sysfs_root: Path = Path("/sys")) -> None:
        self.root = sysfs_root

    def __call__(self, nvml_bus_id: str) -> int | None:
        path = self.root / "bus" / "pci" / "devices" / sysfs_bus_id(nvml_bus_id) / "numa_node"
        try:
            value = int(path.read_text().strip())
        except (FileNotFoundError, ValueError, PermissionError):
            return None
        return value if value >= 0 else None


class TableNuma:
    """NUMA nodes from a table keyed by NVML bus id (the fake machine's equivalent of sysfs)."""

    def __init__(self, table: Mapping[str, int | None]) -> None:
        self.table = {k.upper(): v for k, v in table.items()}

    def __call__(self, nvml_bus_id: str) -> int | None:
        return self.table.get(nvml_bus_id.upper())
