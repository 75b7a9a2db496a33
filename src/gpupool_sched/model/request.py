"""What a pod asks for, reduced to the numbers placement needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

MILLI = 1000  # one whole GPU in milli-GPU


class WorkloadKind(StrEnum):
    """Why the pod runs; policies may treat training and inference differently."""

    TRAINING = "training"
    INFERENCE = "inference"
    BATCH = "batch"
    UNKNOWN = "unknown"


class InvalidRequest(ValueError):
    """A request that no cluster could ever satisfy or that is malformed."""


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod's resource request.

    GPU demand takes one of three shapes:
      * whole GPUs: ``gpu_count=k``, ``gpu_milli=1000``;
      * a share of one GPU: ``gpu_count=1`` and either ``gpu_milli`` in 1..999 (compute share)
        or ``gpu_memory_mib`` > 0 (memory share, what ``nvidia.com/gpu-memory`` units become);
      * MIG slices: ``mig_profile`` (e.g. ``"1g.10gb"``) and ``mig_count``.
    ``gpu_models`` restricts the GPU model (empty: any).
    """

    name: str
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_count: int = 0
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    mig_profile: str | None = None
    mig_count: int = 0
    gpu_models: frozenset[str] = field(default_factory=frozenset)
    priority: int = 0
    kind: WorkloadKind = WorkloadKind.UNKNOWN
    namespace: str = "default"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise InvalidRequest(f"pod {self.name}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every reason this request is malformed, in words a user can act on."""
        out: list[str] = []
        for attr in ("cpu_milli", "memory_mib", "gpu_count", "gpu_milli", "gpu_memory_mib", "mig_count"):
            if getattr(self, attr) < 0:
                out.append(f"{attr} is negative ({getattr(self, attr)})")
        if out:
            return out
        if self.gpu_milli > MILLI:
            out.append(f"gpu_milli {self.gpu_milli} exceeds one GPU ({MILLI}); ask for whole GPUs instead")
        if self.gpu_count and not (self.gpu_milli or self.gpu_memory_mib):
            out.append("gpu_count set without gpu_milli (1000 = whole GPU) or gpu_memory_mib")
        if (self.gpu_milli or self.gpu_memory_mib) and not self.gpu_count:
            out.append("a GPU share needs gpu_count=1")
        if self.gpu_milli and self.gpu_memory_mib:
            out.append("ask for a GPU share either as gpu_milli or as gpu_memory_mib, not both")
        if self.gpu_count > 1 and (self.gpu_memory_mib or 0 < self.gpu_milli < MILLI):
            out.append(f"a GPU share covers exactly one GPU, got gpu_count={self.gpu_count}")
        if bool(self.mig_profile) != bool(self.mig_count):
            out.append("mig_profile and mig_count go together")
        if self.mig_profile and self.gpu_count:
            out.append("a pod asks for MIG slices or for GPUs, not both")
        return out

    @property
    def wants_gpu(self) -> bool:
        return self.gpu_count > 0

    @property
    def is_shared(self) -> bool:
        """A share of one GPU (compute or memory)."""
        return self.gpu_count == 1 and (0 < self.gpu_milli < MILLI or self.gpu_memory_mib > 0)

    @property
    def is_whole(self) -> bool:
        return self.gpu_count > 0 and self.gpu_milli == MILLI

    @property
    def wants_mig(self) -> bool:
        return self.mig_count > 0

    @property
    def gpu_milli_total(self) -> int:
        """GPU demand in milli-GPU, the unit of the allocation metric (memory shares count 0 here)."""
        return self.gpu_count * self.gpu_milli

    def shape(self) -> tuple[int, int, int, int, frozenset[str]]:
        """The request's class for workload statistics: (cpu, milli per GPU, GPUs, memory share, models)."""
        return (self.cpu_milli, self.gpu_milli, self.gpu_count, self.gpu_memory_mib, self.gpu_models)

    def gpu_tag(self) -> str:
        """The GPU request kind, as GPU clustering groups pods: cpu, share, mig, or k-gpu."""
        if self.wants_mig:
            return f"mig-{self.mig_profile}"
        if not self.wants_gpu:
            return "cpu"
        if self.is_shared:
            return "share"
        return f"{self.gpu_count}-gpu"
