"""The workload FGD defragments for, learnt from the pods the cluster has seen.

FGD's fragmentation is an expectation over the workload's task classes (fragmentation.py). A trace
replay knows the whole workload in advance; a running scheduler only knows the pods it has seen.
:class:`RollingProfile` keeps the last ``window`` pods and rebuilds the profile from them every
``refresh_every`` pods, starting from a fixed prior (:func:`default_prior`) until
``min_observations`` pods were seen.

Policies compile a profile against the cluster and memoise scores by the profile's identity, so the
profile object only changes when it is rebuilt *and* differs from the current one; ``version``
counts those changes, and a caller rebuilds its policy when it moves.

Memory shares (``gpu_memory_mib``) enter the classes as the milli-GPU they take on a typical GPU of
the cluster (``typical_gpu_memory_mib``, e.g. :func:`typical_gpu_memory_mib` of the nodes). MIG
requests stay out: MIG devices live on MIG-enabled GPUs, which never take whole or shared pods, so a
MIG pod neither suffers nor causes fragmentation of the GPUs FGD looks at.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.fragmentation import TaskClass, WorkloadProfile

if TYPE_CHECKING:
    from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec

# The prior: the GPU request mix of Alibaba's openb default trace (8,152 pods of a production cluster
# shared by training and inference, the FGD paper's workload) grouped by GPU shape: the shapes that
# cover 95% of its pods, each with the median CPU of its pods, plus the rare 2/4/8-GPU jobs.
# (cpu_milli, gpu_milli per GPU, GPUs, pods)
PRIOR_CLASSES: tuple[tuple[int, int, int, int], ...] = (
    (11_400, 1000, 1, 3911),
    (12_500, 0, 0, 1088),  # CPU-only pods on GPU nodes
    (3_152, 810, 1, 1078),
    (11_908, 470, 1, 750),
    (4_000, 320, 1, 328),
    (11_908, 650, 1, 253),
    (4_000, 230, 1, 140),
    (6_000, 460, 1, 128),
    (3_152, 590, 1, 75),
    (88_000, 1000, 8, 44),
    (16_200, 1000, 2, 16),
    (32_200, 1000, 4, 15),
)
PRIOR_CPU_PER_GPU_MILLI = 10.88  # the trace's milli-CPU per milli-GPU over all GPU pods (~11 cores per GPU)
PRIOR_MEM_PER_GPU_MILLI = 41.14  # MiB per milli-GPU (~41 GiB per GPU)


def default_prior() -> WorkloadProfile:
    """The profile used before enough pods were seen.

    A GPU-sharing production mix (see PRIOR_CLASSES): mostly single whole GPUs, the common compute
    shares (810, 470, 320, 650, 230, 460, 590 milli), CPU-only pods, and 2/4/8-GPU jobs. It has no
    GPU model constraints, so every class can run on any cluster. Why this and not nothing: an empty
    profile makes FGD blind (every placement scores the same), while this one makes a fresh
    scheduler pack shares onto partly used GPUs and keep whole GPUs and whole nodes free for
    training jobs, which is right for a training + inference pool until its own pods say otherwise.
    The 2/4/8-GPU classes are below the 95% coverage in the trace and are kept on purpose: whole-node
    jobs are what fragmentation hurts most."""
    classes = tuple(TaskClass(cpu, milli, k, frozenset(), n) for cpu, milli, k, n in PRIOR_CLASSES)
    return WorkloadProfile(classes, PRIOR_CPU_PER_GPU_MILLI, PRIOR_MEM_PER_GPU_MILLI)


def memory_share_milli(memory_mib: int, gpu_memory_mib: int) -> int:
    """Milli-GPU that a ``memory_mib`` memory share takes on a GPU of ``gpu_memory_mib`` (1..1000),
    rounded down as the placement core does (framework.CycleState.gpu_take)."""
    if gpu_memory_mib <= 0:
        raise ValueError(f"GPU memory must be > 0 MiB, got {gpu_memory_mib}")
    return min(MILLI, max(1, memory_mib * MILLI // gpu_memory_mib))


def _memory_sizes(node: NodeSpec) -> Counter[int]:
    return Counter(g.memory_mib for g in node.gpus if g.memory_mib > 0 and not g.mig_enabled)


def _most_common(sizes: Counter[int]) -> int:
    positive = [(count, size) for size, count in sizes.items() if count > 0]
    return max(positive)[1] if positive else 0


def typical_gpu_memory_mib(nodes: Iterable[NodeSpec]) -> int:
    """The most common memory size of the GPUs that take whole or shared pods (ties: the larger);
    0 when no GPU publishes its memory (trace replays)."""
    sizes: Counter[int] = Counter()
    for node in nodes:
        sizes.update(_memory_sizes(node))
    return _most_common(sizes)


class GpuMemorySizes:
    """``typical_gpu_memory_mib`` kept up to date node by node (a live cluster's nodes change one at a
    time; recounting every GPU on each node event costs O(cluster) per event)."""

    def __init__(self) -> None:
        self._by_node: dict[str, Counter[int]] = {}
        self._sizes: Counter[int] = Counter()

    def update(self, name: str, node: NodeSpec | None) -> None:
        """``node``'s GPUs replace what ``name`` had (None: the node is gone)."""
        old = self._by_node.pop(name, None)
        if old is not None:
            self._sizes.subtract(old)
        if node is not None:
            new = _memory_sizes(node)
            self._by_node[name] = new
            self._sizes.update(new)

    def typical(self) -> int:
        return _most_common(self._sizes)


class RollingProfile:
    """The workload profile of the last ``window`` pods seen, rebuilt every ``refresh_every`` pods.

    ``profile()`` returns the prior until ``min_observations`` pods were seen, then the profile of
    the window. A rebuild that yields an equal profile (or no class at all: a window of MIG pods)
    keeps the current object and version. ``typical_gpu_memory_mib`` (0: unknown) converts memory
    shares; without it they are left out of the classes, as in WorkloadProfile.from_requests."""

    def __init__(
        self,
        window: int = 2000,
        coverage: float = 0.95,
        *,
        prior: WorkloadProfile | None = None,
        min_observations: int = 50,
        refresh_every: int = 100,
        typical_gpu_memory_mib: int = 0,
        spec_of: Callable[[PodRequest], str] | None = None,
    ) -> None:
        if window < 1 or refresh_every < 1 or min_observations < 1:
            raise ValueError("window, refresh_every and min_observations must be >= 1")
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        if typical_gpu_memory_mib < 0:
            raise ValueError(f"typical GPU memory must be >= 0 MiB, got {typical_gpu_memory_mib}")
        self.coverage = coverage
        self.min_observations = min_observations
        self.refresh_every = refresh_every
        self.typical_gpu_memory_mib = typical_gpu_memory_mib
        self.spec_of = spec_of
        self._memory_sizes = GpuMemorySizes()
        self._window: deque[PodRequest] = deque(maxlen=window)
        self._seen = 0
        self._since_refresh = 0
        self._learnt = False
        self._profile = prior if prior is not None else default_prior()
        self._version = 0

    @property
    def window(self) -> int:
        return self._window.maxlen or 0

    @property
    def seen(self) -> int:
        """Pods observed so far (also those that have left the window)."""
        return self._seen

    @property
    def version(self) -> int:
        """Bumps whenever :meth:`profile` starts returning a new object."""
        return self._version

    def profile(self) -> WorkloadProfile:
        """The current profile: the same object until a refresh changes it."""
        return self._profile

    def node_changed(self, name: str, node: NodeSpec | None) -> None:
        """A live cluster's node was added, changed or (None) removed: ``typical_gpu_memory_mib`` follows,
        so that memory shares enter the task classes as milli-GPU of the cluster's typical GPU."""
        self._memory_sizes.update(name, node)
        self.typical_gpu_memory_mib = self._memory_sizes.typical()

    def observe(self, request: PodRequest) -> None:
        """One pod seen: it enters the window (the oldest leaves); may refresh the profile."""
        self._window.append(request)
        self._seen += 1
        if self._seen < self.min_observations:
            return
        self._since_refresh += 1
        if not self._learnt or self._since_refresh >= self.refresh_every:
            self._refresh()

    def _memory_to_milli(self) -> Callable[[int], int] | None:
        typical = self.typical_gpu_memory_mib
        if not typical:
            return None
        return lambda mib: memory_share_milli(mib, typical)

    def _refresh(self) -> None:
        self._since_refresh = 0
        self._learnt = True
        new = WorkloadProfile.from_requests(
            self._window, self.coverage, spec_of=self.spec_of, memory_to_milli=self._memory_to_milli()
        )
        if new.classes and new != self._profile:
            self._profile = new
            self._version += 1


def forget_profile(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> int:
    """Drop what ``snapshot`` cached for ``profile`` (fragmentation.cached_for_profile entries: the
    compiled model, per-node fragmentation, FGD's shape memo of up to 64 MiB). A caller that replaces
    a rolling profile calls this for the old one, or the snapshot keeps every past profile's caches.
    Returns how many entries were dropped."""
    stale = [key for key, entry in snapshot.caches.items() if isinstance(entry, tuple) and entry[0] is profile]
    for key in stale:
        del snapshot.caches[key]
        snapshot.carried.pop(key, None)
    return len(stale)
