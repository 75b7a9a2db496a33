"""What a pod asks for, reduced to the numbers placement needs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpupool_sched.model.constraints import NodeConstraints

MILLI = 1000  # one whole GPU in milli-GPU

_GPU_FIELDS = ("gpu_count", "gpu_milli", "gpu_memory_mib", "mig_profile", "mig_count")


class WorkloadKind(StrEnum):
    """Why the pod runs; policies may treat training and inference differently."""

    TRAINING = "training"
    INFERENCE = "inference"
    BATCH = "batch"
    UNKNOWN = "unknown"


class InvalidRequest(ValueError):
    """A request that no cluster could ever satisfy or that is malformed."""


def gpu_problems(
    gpu_count: int, gpu_milli: int, gpu_memory_mib: int, mig_profile: str | None, mig_count: int
) -> list[str]:
    """Every reason one GPU demand (whole GPUs, a share of one GPU, or MIG slices) is malformed."""
    out: list[str] = []
    for attr, value in (
        ("gpu_count", gpu_count),
        ("gpu_milli", gpu_milli),
        ("gpu_memory_mib", gpu_memory_mib),
        ("mig_count", mig_count),
    ):
        if value < 0:
            out.append(f"{attr} is negative ({value})")
    if out:
        return out
    if gpu_milli > MILLI:
        out.append(f"gpu_milli {gpu_milli} exceeds one GPU ({MILLI}); ask for whole GPUs instead")
    if gpu_count and not (gpu_milli or gpu_memory_mib):
        out.append("gpu_count set without gpu_milli (1000 = whole GPU) or gpu_memory_mib")
    if (gpu_milli or gpu_memory_mib) and not gpu_count:
        out.append("a GPU share needs gpu_count=1")
    if gpu_milli and gpu_memory_mib:
        out.append("ask for a GPU share either as gpu_milli or as gpu_memory_mib, not both")
    if gpu_count > 1 and (gpu_memory_mib or 0 < gpu_milli < MILLI):
        out.append(f"a GPU share covers exactly one GPU, got gpu_count={gpu_count}")
    if bool(mig_profile) != bool(mig_count):
        out.append("mig_profile and mig_count go together")
    if mig_profile and gpu_count:
        out.append("a pod asks for MIG slices or for GPUs, not both")
    return out


@dataclass(frozen=True, slots=True)
class GpuShape:
    """One kind of GPU demand of a pod: whole GPUs, a share of one GPU, or MIG slices of one profile.

    Fields mean what :class:`PodRequest`'s GPU fields mean. A pod whose containers ask for several
    kinds (e.g. whole GPUs and a gpu-memory share) is built with :meth:`PodRequest.of_shapes`."""

    gpu_count: int = 0
    gpu_milli: int = 0
    gpu_memory_mib: int = 0
    mig_profile: str | None = None
    mig_count: int = 0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise InvalidRequest(f"GPU shape {self.describe()}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        return gpu_problems(self.gpu_count, self.gpu_milli, self.gpu_memory_mib, self.mig_profile, self.mig_count)

    @property
    def is_empty(self) -> bool:
        return not (self.gpu_count or self.mig_count)

    @property
    def is_whole(self) -> bool:
        return self.gpu_count > 0 and self.gpu_milli == MILLI

    @property
    def is_shared(self) -> bool:
        return self.gpu_count == 1 and (0 < self.gpu_milli < MILLI or self.gpu_memory_mib > 0)

    @property
    def wants_mig(self) -> bool:
        return self.mig_count > 0

    def order_key(self) -> tuple[int, str]:
        """Whole GPUs first, then a share, then MIG slices by profile name (the primary shape comes first)."""
        if self.wants_mig:
            return (2, self.mig_profile or "")
        return (0, "") if self.is_whole else (1, "")

    def describe(self) -> str:
        if self.wants_mig:
            return f"{self.mig_count}x MIG {self.mig_profile}"
        if self.gpu_memory_mib:
            return f"{self.gpu_memory_mib} MiB of one GPU"
        if self.is_whole:
            return f"{self.gpu_count} whole GPU(s)"
        if self.gpu_count or self.gpu_milli:
            return f"{self.gpu_milli}/{MILLI} of {self.gpu_count} GPU"
        return "no GPU"


def shape_problems(shapes: Sequence[GpuShape]) -> list[str]:
    """Reasons a set of shapes cannot be one pod's demand: each kind may appear once (merge counts)."""
    out: list[str] = []
    kinds = Counter("whole" if s.is_whole else "share" if s.is_shared else f"MIG {s.mig_profile}" for s in shapes)
    if kinds["whole"] > 1:
        out.append(f"{kinds['whole']} whole-GPU shapes; a pod asks for its whole GPUs in one shape (add the counts)")
    if kinds["share"] > 1:
        out.append(f"{kinds['share']} GPU-share shapes; a pod may hold at most one share of a GPU")
    for kind, n in sorted(kinds.items()):
        if kind.startswith("MIG ") and n > 1:
            out.append(f"{n} shapes of {kind}; a pod asks for each MIG profile once (add the counts)")
    return out


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod's resource request.

    The primary GPU demand takes one of three shapes:
      * whole GPUs: ``gpu_count=k``, ``gpu_milli=1000``;
      * a share of one GPU: ``gpu_count=1`` and either ``gpu_milli`` in 1..999 (compute share)
        or ``gpu_memory_mib`` > 0 (memory share, what ``nvidia.com/gpu-memory`` units become);
      * MIG slices: ``mig_profile`` (e.g. ``"1g.10gb"``) and ``mig_count``.
    ``extra`` holds further shapes of a pod whose containers ask for several kinds; they go to the
    same node, on GPUs (MIG devices) disjoint from the primary's and each other's. Build such pods
    with :meth:`of_shapes`, which puts the shapes in canonical order. ``gpu_models`` restricts the
    GPU model of every shape (empty: any); ``constraints`` are the pod's node selector, required
    node affinity and tolerations.
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
    extra: tuple[GpuShape, ...] = ()
    constraints: NodeConstraints | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.extra, tuple):
            object.__setattr__(self, "extra", tuple(self.extra))
        problems = self.problems()
        if problems:
            raise InvalidRequest(f"pod {self.name}: " + "; ".join(problems))

    @classmethod
    def of_shapes(cls, name: str, shapes: Sequence[GpuShape], **fields: Any) -> PodRequest:
        """A pod asking for ``shapes`` together (no shapes: a CPU-only pod). The first shape in the
        order whole > share > MIG (by profile) becomes the primary, the rest ``extra``. ``fields`` are
        the other PodRequest fields (cpu_milli, memory_mib, gpu_models, constraints, ...)."""
        given = sorted(set(fields) & {*_GPU_FIELDS, "extra"})
        if given:
            raise InvalidRequest(f"pod {name}: give the GPU demand as shapes, not as {', '.join(given)}")
        problems: list[str] = []
        for k, shape in enumerate(shapes):
            if not isinstance(shape, GpuShape):
                problems.append(f"shape {k} is a {type(shape).__name__}, not a GpuShape")
            elif shape.is_empty:
                problems.append(f"shape {k} asks for no GPU")
            else:
                problems.extend(f"shape {k}: {p}" for p in shape.problems())
        if not problems:
            problems = shape_problems(shapes)
        if problems:
            raise InvalidRequest(f"pod {name}: " + "; ".join(problems))
        ordered = sorted(shapes, key=GpuShape.order_key)
        if not ordered:
            return cls(name=name, **fields)
        primary, *rest = ordered
        return cls(
            name=name,
            gpu_count=primary.gpu_count,
            gpu_milli=primary.gpu_milli,
            gpu_memory_mib=primary.gpu_memory_mib,
            mig_profile=primary.mig_profile,
            mig_count=primary.mig_count,
            extra=tuple(rest),
            **fields,
        )

    def problems(self) -> list[str]:
        """Every reason this request is malformed, in words a user can act on."""
        out: list[str] = []
        for attr in ("cpu_milli", "memory_mib"):
            if getattr(self, attr) < 0:
                out.append(f"{attr} is negative ({getattr(self, attr)})")
        out.extend(gpu_problems(self.gpu_count, self.gpu_milli, self.gpu_memory_mib, self.mig_profile, self.mig_count))
        if out or not self.extra:
            return out
        if not (self.wants_gpu or self.wants_mig):
            out.append("extra GPU shapes need a primary GPU shape (build multi-shape pods with of_shapes)")
        for k, shape in enumerate(self.extra):
            if not isinstance(shape, GpuShape):
                out.append(f"extra[{k}] is a {type(shape).__name__}, not a GpuShape")
            elif shape.is_empty:
                out.append(f"extra[{k}] asks for no GPU")
            else:
                out.extend(f"extra[{k}]: {p}" for p in shape.problems())
        if not out:
            out.extend(shape_problems(self.gpu_shapes()))
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
        """Primary GPU demand in milli-GPU, the unit of the allocation metric (memory shares count 0 here)."""
        return self.gpu_count * self.gpu_milli

    def primary_shape(self) -> GpuShape | None:
        """The primary GPU demand as a shape (None for CPU-only pods)."""
        if not (self.wants_gpu or self.wants_mig):
            return None
        return GpuShape(self.gpu_count, self.gpu_milli, self.gpu_memory_mib, self.mig_profile, self.mig_count)

    def gpu_shapes(self) -> tuple[GpuShape, ...]:
        """Every GPU demand of the pod, primary first (empty for CPU-only pods)."""
        primary = self.primary_shape()
        return () if primary is None else (primary, *self.extra)

    def shape(self) -> tuple[int, int, int, int, frozenset[str]]:
        """The request's class for workload statistics: (cpu, milli per GPU, GPUs, memory share, models)."""
        return (self.cpu_milli, self.gpu_milli, self.gpu_count, self.gpu_memory_mib, self.gpu_models)

    def gpu_tag(self) -> str:
        """The primary GPU request kind, as GPU clustering groups pods: cpu, share, mig, or k-gpu."""
        if self.wants_mig:
            return f"mig-{self.mig_profile}"
        if not self.wants_gpu:
            return "cpu"
        if self.is_shared:
            return "share"
        return f"{self.gpu_count}-gpu"
