"""GPU interconnect topology of one node: NVLink counts and PCIe levels between every GPU pair.

Plain data, built from the device plugin's published inventory (or by the simulator). GPUs are
referred to by their NVML index on the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum


class PcieLevel(IntEnum):
    """NVML's topology levels (nvmlGpuTopologyLevel_t): the closest common ancestor of two GPUs."""

    INTERNAL = 0  # same board (multi-GPU card)
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # the same PCIe host bridge
    NODE = 40  # host bridges of the same NUMA node (same CPU socket)
    SYSTEM = 50  # across sockets (SMP interconnect)

    @classmethod
    def parse(cls, value: PcieLevel | str | int) -> PcieLevel:
        if isinstance(value, str):
            return cls[value.upper()]
        return cls(value)


@dataclass(frozen=True, slots=True)
class NodeTopology:
    """Symmetric per-pair matrices; the diagonal is (0 NVLinks, INTERNAL)."""

    numa: tuple[int | None, ...]
    nvlinks: tuple[tuple[int, ...], ...]
    pcie: tuple[tuple[PcieLevel, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.numa)
        for name, matrix in (("nvlinks", self.nvlinks), ("pcie", self.pcie)):
            if len(matrix) != n or any(len(row) != n for row in matrix):
                raise ValueError(f"NodeTopology.{name} must be {n}x{n}")
            for a in range(n):
                for b in range(a + 1, n):
                    if matrix[a][b] != matrix[b][a]:
                        raise ValueError(f"NodeTopology.{name} is not symmetric at ({a}, {b})")

    @property
    def gpu_count(self) -> int:
        return len(self.numa)

    @classmethod
    def from_links(
        cls, numa: Sequence[int | None], links: Iterable[tuple[int, int, int, PcieLevel | str | int]]
    ) -> NodeTopology:
        """From (gpu a, gpu b, NVLink count, PCIe level) per pair. A pair not listed has no NVLink and
        a PCIe level guessed from NUMA: NODE when both GPUs share a NUMA node, else SYSTEM."""
        n = len(numa)
        nv = [[0] * n for _ in range(n)]
        lv = [[PcieLevel.INTERNAL if a == b else cls._guess(numa, a, b) for b in range(n)] for a in range(n)]
        for a, b, count, level in links:
            if not (0 <= a < n and 0 <= b < n) or a == b:
                raise ValueError(f"bad GPU pair ({a}, {b}) for a node with {n} GPUs")
            nv[a][b] = nv[b][a] = int(count)
            lv[a][b] = lv[b][a] = PcieLevel.parse(level)
        return cls(tuple(numa), tuple(map(tuple, nv)), tuple(map(tuple, lv)))

    @classmethod
    def uniform(
        cls, gpu_count: int, *, nvlinks: int = 0, level: PcieLevel = PcieLevel.SYSTEM, numa: int | None = None
    ) -> NodeTopology:
        """Every pair alike (what the simulator uses when a trace has no topology)."""
        pairs = [(a, b, nvlinks, level) for a in range(gpu_count) for b in range(a + 1, gpu_count)]
        return cls.from_links([numa] * gpu_count, pairs)

    @staticmethod
    def _guess(numa: Sequence[int | None], a: int, b: int) -> PcieLevel:
        return PcieLevel.NODE if numa[a] is not None and numa[a] == numa[b] else PcieLevel.SYSTEM
