"""GPU fragmentation as defined by FGD (Weng et al., "Beware of Fragmentation", USENIX ATC'23).

A node's idle GPU capacity is a *fragment* for a task class when that class cannot use it: all of
it when the class cannot run on the node at all (wrong GPU model, not enough CPU, too few GPUs with
enough room, or a CPU-only class), otherwise the idle capacity of the GPUs with less room than the
class needs per GPU. The node's fragmentation is the expectation over the workload's task classes,
weighted by how often each class occurs.

Writing ``S`` for the node's idle milli-GPU and ``H_u`` for the idle milli-GPU held by GPUs with at
least ``u`` free, the fragment of class m is ``S - [m fits] * H_{u_m}``, so

    F = S - sum_m p_m * [m fits] * H_{u_m}        (with sum_m p_m = 1)

which needs only a handful of per-threshold counts per node and vectorises over nodes and GPUs.
Everything is kept in exact integers (class counts times milli-GPU) so that equal fragmentation
compares equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import MILLI, PodRequest

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TaskClass:
    """A kind of task: CPU, milli-GPU per GPU (0: CPU-only), GPUs, accepted models, and how many seen."""

    cpu_milli: int
    gpu_milli: int
    gpu_count: int
    models: frozenset[str]
    count: int
    spec: str = ""  # the model constraint as written; classes are told apart (and ordered) by it

    def sort_key(self) -> tuple[int, int, int, int, str]:
        return (self.count, self.cpu_milli, self.gpu_milli, self.gpu_count, self.spec)


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    """The target workload: the most frequent task classes covering ``coverage`` of all tasks, plus
    how much CPU and memory the GPU tasks bring per milli-GPU (for stranding, see stranding.py)."""

    classes: tuple[TaskClass, ...]
    cpu_per_gpu_milli: float = 0.0  # milli-CPU requested per milli-GPU, over all GPU tasks
    mem_per_gpu_milli: float = 0.0  # MiB requested per milli-GPU

    @property
    def total(self) -> int:
        return sum(c.count for c in self.classes)

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[PodRequest],
        coverage: float = 0.95,
        spec_of: Callable[[PodRequest], str] | None = None,
        memory_to_milli: Callable[[int], int] | None = None,
    ) -> WorkloadProfile:
        """Most frequent classes first (ties: larger CPU, then milli, GPUs, spec), until their tasks
        make up at least ``coverage`` of all tasks (the FGD artifact's 'typical pods').

        ``spec_of`` gives a request's model constraint as written (default: the sorted model names);
        the trace replay passes the trace's own strings, which the FGD artifact keys classes by.
        ``memory_to_milli`` turns a memory share (MiB) into the milli-GPU it takes on a typical GPU
        (1..1000); without it memory shares are left out. MIG requests are always left out: MIG slices
        live on MIG-enabled GPUs, which never take whole or shared pods, so they do not fragment them.
        Only a request's primary GPU shape counts."""
        counts: Counter[tuple[int, int, int, str]] = Counter()
        models_of: dict[str, frozenset[str]] = {}
        gpu = cpu = mem = 0
        for r in requests:
            if r.wants_mig:
                continue
            if r.gpu_memory_mib:
                if memory_to_milli is None:
                    continue
                milli = memory_to_milli(r.gpu_memory_mib)
                if not 0 < milli <= MILLI:
                    raise ValueError(f"memory_to_milli({r.gpu_memory_mib}) gave {milli}, expected 1..{MILLI}")
            else:
                milli = r.gpu_milli if r.wants_gpu else 0
            if milli:
                gpu += milli * r.gpu_count
                cpu += r.cpu_milli
                mem += r.memory_mib
            spec = spec_of(r) if spec_of else "|".join(sorted(r.gpu_models))
            models_of[spec] = r.gpu_models
            counts[(r.cpu_milli, milli, r.gpu_count, spec)] += 1
        ordered = sorted(
            (TaskClass(cpu, milli, k, models_of[spec], n, spec) for (cpu, milli, k, spec), n in counts.items()),
            key=TaskClass.sort_key,
            reverse=True,
        )
        total = sum(c.count for c in ordered)
        chosen: list[TaskClass] = []
        covered = 0
        for c in ordered:
            if covered >= coverage * total:
                break
            chosen.append(c)
            covered += c.count
        return cls(tuple(chosen), cpu / gpu if gpu else 0.0, mem / gpu if gpu else 0.0)


class FragmentationModel:
    """A :class:`WorkloadProfile` compiled against one cluster's nodes (static parts only)."""

    def __init__(self, profile: WorkloadProfile, snapshot: ClusterSnapshot) -> None:
        self.profile = profile
        self.weight_total = profile.total  # F is kept multiplied by this, in exact integers
        gpu_classes = [c for c in profile.classes if c.gpu_milli > 0]
        self.thresholds = np.array(sorted({c.gpu_milli for c in gpu_classes}), dtype=np.int64)
        u_pos = {u: i for i, u in enumerate(self.thresholds.tolist())}
        self.cls_u = np.array([u_pos[c.gpu_milli] for c in gpu_classes], dtype=np.int64)
        self.cls_k = np.array([c.gpu_count for c in gpu_classes], dtype=np.int64)
        self.cls_cpu = np.array([c.cpu_milli for c in gpu_classes], dtype=np.int64)
        self.cls_w = np.array([c.count for c in gpu_classes], dtype=np.int64)
        self.cls_w_float = self.cls_w.astype(np.float64)
        # [nodes, gpu classes]: the node has GPUs of a model the class accepts
        has_gpu = snapshot.gpu_usable.any(axis=1)
        cols = [
            (snapshot.allowed_models(c.models) & snapshot.gpu_usable).any(axis=1) if c.models else has_gpu
            for c in gpu_classes
        ]
        self.model_ok = np.stack(cols, axis=1) if cols else np.zeros((len(snapshot), 0), dtype=bool)

    def _class_sum(self, cnt: np.ndarray, held: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """sum_m w_m [m fits] H_{u_m}; ``cnt``/``held`` are [..., U], ``ok`` broadcasts to [..., M].

        The terms are integers far below 2**53, so float64 sums (BLAS) are exact."""
        fits = ok & (cnt[..., self.cls_u] >= self.cls_k)
        return np.where(fits, held[..., self.cls_u], 0.0) @ self.cls_w_float

    def _class_ok(self, cpu: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        return self.model_ok[nodes] & (cpu[:, None] >= self.cls_cpu)  # type: ignore[no-any-return]

    def _threshold_stats(self, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ge = free[..., None] >= self.thresholds
        return ge.sum(axis=-2), np.where(ge, free[..., None], 0).sum(axis=-2)

    def frag(self, free: np.ndarray, cpu: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Weighted fragmentation (times ``weight_total``) of nodes with GPU state ``free`` [C, G]
        (milli free per GPU, negative for absent GPUs) and ``cpu`` [C] milli-CPU free."""
        idle = np.clip(free, 0, None).sum(axis=1)
        cnt, held = self._threshold_stats(free)
        return (  # type: ignore[no-any-return]
            idle * self.weight_total - self._class_sum(cnt, held, self._class_ok(cpu, nodes)).astype(np.int64)
        )

    def frag_after_share(
        self, free: np.ndarray, cpu_after: np.ndarray, nodes: np.ndarray, take: int, rows: np.ndarray, gpus: np.ndarray
    ) -> np.ndarray:
        """Fragmentation after taking ``take`` milli from GPU ``gpus[p]`` of candidate ``rows[p]``,
        for each pair p (``free`` [C, G] and ``cpu_after`` [C] are per candidate)."""
        cnt, held = self._threshold_stats(free)  # [C, U]
        g = free[rows, gpus]
        after = g - take
        ge = g[:, None] >= self.thresholds  # [P, U]
        ge_after = after[:, None] >= self.thresholds
        cnt_p = cnt[rows] - ge + ge_after
        held_p = held[rows] - np.where(ge, g[:, None], 0) + np.where(ge_after, after[:, None], 0)
        idle = np.clip(free, 0, None).sum(axis=1)[rows] - take
        ok = self._class_ok(cpu_after, nodes)[rows]
        return (  # type: ignore[no-any-return]
            idle * self.weight_total - self._class_sum(cnt_p, held_p, ok).astype(np.int64)
        )


def cached_for_profile(snapshot: ClusterSnapshot, kind: str, profile: WorkloadProfile, build: Callable[[], T],
                       carry: Callable[[T], T] | None = None) -> T:
    """Derived data of ``snapshot`` for ``profile``, cached on the snapshot. Keyed by the profile's
    identity and checked against it, so a new profile never inherits a freed one's cache. ``carry``: a
    copy of the snapshot starts from ``carry(value)`` (``ClusterSnapshot.carried``) instead of nothing."""
    key = (kind, id(profile))
    entry = snapshot.caches.get(key)
    if not isinstance(entry, tuple) or entry[0] is not profile:
        entry = (profile, build())
        snapshot.caches[key] = entry
        if carry is not None:
            snapshot.carried[key] = lambda kept: (kept[0], carry(kept[1]))
    return entry[1]  # type: ignore[no-any-return]


def _same(value: T) -> T:
    """What a copy carries of data that depends on the node set only (never changed in place): itself."""
    return value


def _rows_copy(value: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """What a copy carries of per-row values checked against row versions: its own copy of both arrays
    (each snapshot updates them in place; a version is never reused, so a carried value stays right)."""
    return value[0].copy(), value[1].copy()


def fragmentation_model(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> FragmentationModel:
    """The compiled model for this snapshot, cached on it."""
    return cached_for_profile(snapshot, "fragmentation-model", profile, lambda: FragmentationModel(profile, snapshot),
                              _same)


def node_fragmentation(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> np.ndarray:
    """Per-node fragmentation (times the profile's weight total), kept current by version checks."""
    model = fragmentation_model(snapshot, profile)
    versions, values = cached_for_profile(
        snapshot,
        "node-fragmentation",
        profile,
        lambda: (np.full(len(snapshot), -1, dtype=np.int64), np.zeros(len(snapshot), dtype=np.int64)),
        _rows_copy,
    )
    stale = np.flatnonzero(versions != snapshot.version)
    if stale.size:
        values[stale] = model.frag(snapshot.free_milli[stale], snapshot.cpu_free[stale], stale)
        versions[stale] = snapshot.version[stale]
    return values


def cluster_fragmentation_milli(snapshot: ClusterSnapshot, profile: WorkloadProfile) -> float:
    """Total fragmented GPU capacity of the cluster, in milli-GPU."""
    model = fragmentation_model(snapshot, profile)
    return float(node_fragmentation(snapshot, profile).sum()) / max(model.weight_total, 1)
