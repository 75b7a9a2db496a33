"""Background consolidation, the decision: which shared tenants to move, and where, so that a partly used
GPU comes free whole (and, GPU by GPU, whole nodes) for training, with no pod waiting for it. Pure, like
``plan_consolidation``, whose machinery it uses (`place_movers`: every mover has a destination or
nothing moves; `moved`, `overcommitted`); the scheduler's background mode (scheduler/defrag.py) and a
simulator carry out its answer themselves (reservations, then the Eviction API).

* **Sources.** A GPU is emptied only when everything accounted on it is a tenant the caller lets move
  (``movable``: single-GPU shares, a compute or a memory share; no whole GPUs, MIG devices or multi-GPU
  pods). A GPU holding anything else (a pod not movable now, a reservation, a hold) is never a source.
  Sources are tried the least used GPU memory first (the cheapest move), then on the node with the
  fewest used GPUs (so that nodes drain whole), then the snapshot's tie order, then the GPU index; at
  most ``max_sources`` are tried.
* **Destinations.** Only GPUs already partly used (a whole free GPU is never taken: nothing new is
  fragmented), never the source GPU, never on a ``busy`` node (a migration under way there; a busy
  node's GPUs are no source either). A tenant goes where the policy's filter chain accepts it (node
  affinity, taints, CPU, memory, the GPU model) on the GPU it fills the most (best fit), on the node
  with the most GPUs in use (packing), then by the tie order. Every tenant of the source must have a
  destination in the same plan, or it is not emptied.
* **Gain.** A plan is made only when it gains: the count of whole free GPUs goes up by construction
  (the source comes free, no free GPU is taken) and, with a ``profile``, the FGD fragmentation of the
  cluster (`cluster_fragmentation_milli`) must not go up. Otherwise the next source is tried.

It terminates and does not loop: every plan adds a whole free GPU and takes none, so the count of whole
free GPUs strictly grows from plan to plan (and is bounded). The GPU a plan frees is no source again (it
holds nothing) and its movers' destinations only fill up; planning again on the state a plan leaves
moves nothing for that GPU, and nothing at all once no partly used GPU can be emptied into the others.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI
from gpupool_sched.placement.consolidation import (
    DEFAULT_MAX_MOVERS,
    Movable,
    Move,
    memory_held_mib,
    moved,
    overcommitted,
    place_movers,
)
from gpupool_sched.placement.decide import feasible_nodes
from gpupool_sched.placement.fragmentation import WorkloadProfile, cluster_fragmentation_milli
from gpupool_sched.placement.framework import CycleState, Policy

DEFAULT_MAX_SOURCES = 8  # GPUs whose tenants are re-placed before giving up (each costs a filter pass per tenant)


@dataclass(frozen=True, slots=True)
class Gathering:
    """Move ``moves`` (every tenant of GPU ``gpu`` of ``node``) onto partly used GPUs: that GPU comes free."""

    node: str
    gpu: int
    moves: tuple[Move, ...]
    free_gpus_before: int
    free_gpus_after: int
    fragmentation_before: float | None = None  # milli-GPU (cluster_fragmentation_milli); None: no profile
    fragmentation_after: float | None = None
    node_freed: bool = False  # every GPU of the node is free once the plan is carried out
    considered: int = field(default=0, compare=False)  # source GPUs tried

    @property
    def memory_moved_mib(self) -> int:
        return sum(m.memory_mib for m in self.moves)


def free_gpu_mask(snapshot: ClusterSnapshot) -> np.ndarray:
    """[nodes, slots]: usable GPUs nothing is accounted on (whole free)."""
    free = (snapshot.free_milli == MILLI) & (snapshot.gpu_mem_free == snapshot.gpu_mem_total)
    return snapshot.gpu_usable & free  # type: ignore[no-any-return]


def free_gpus(snapshot: ClusterSnapshot) -> int:
    """The count of whole free GPUs (the number background consolidation raises)."""
    return int(free_gpu_mask(snapshot).sum())


def gpus_vacated(snapshot: ClusterSnapshot, moves: Sequence[Move]) -> int:
    """Whole GPUs that come free once every mover has left its devices (their destinations as `snapshot`
    has them: held already, or not): what a migration frees, for either kind of move."""
    after = snapshot.copy()
    for move in moves:
        after.release(move.pod.request, move.pod.placement)
    return max(0, free_gpus(after) - free_gpus(snapshot))


def _single_share(m: Movable) -> bool:
    r, p = m.pod.request, m.pod.placement
    return (r.is_shared and not r.extra and not p.extras and len(p.gpu_indices) == 1 and not p.mig_devices
            and p.gpu_milli < MILLI)


def plan_background(
    snapshot: ClusterSnapshot,
    movable: Sequence[Movable],
    policy: Policy,
    *,
    profile: WorkloadProfile | None = None,
    busy: frozenset[str] = frozenset(),
    max_movers: int = DEFAULT_MAX_MOVERS,
    max_sources: int = DEFAULT_MAX_SOURCES,
) -> Gathering | None:
    """The tenants to move so that one partly used GPU comes free, each with its destination on another
    partly used GPU; None when no GPU can be emptied with at most ``max_movers`` moves, or when doing so
    would raise the FGD fragmentation for ``profile``. ``snapshot`` is not modified; a UID given twice is a
    ValueError."""
    if max_movers < 1:
        raise ValueError(f"max_movers must be at least 1, got {max_movers}")
    seen: set[str] = set()
    on_gpu: dict[tuple[int, int], list[Movable]] = defaultdict(list)
    for m in movable:
        if m.pod.uid in seen:
            raise ValueError(f"movable pod {m.pod.uid} is given twice")
        seen.add(m.pod.uid)
        row = snapshot.index.get(m.pod.node)
        if row is not None and m.pod.node not in busy and _single_share(m):
            on_gpu[(row, m.pod.placement.gpu_indices[0])].append(m)
    if not on_gpu:
        return None

    free = free_gpu_mask(snapshot)
    used = snapshot.gpu_usable & ~free
    used_per_node = used.sum(axis=1)
    tie = snapshot.tie_rank
    sources = []
    for (row, j), tenants in on_gpu.items():
        if len(tenants) > max_movers or not used[row, j]:
            continue
        # everything accounted on the GPU is one of these tenants: nothing else stays (or is held) there
        milli = sum(t.pod.placement.gpu_milli for t in tenants)
        mib = sum(t.pod.placement.gpu_memory_mib for t in tenants)
        if (MILLI - snapshot.free_milli[row, j] != milli
                or snapshot.gpu_mem_total[row, j] - snapshot.gpu_mem_free[row, j] != mib):
            continue
        sources.append((mib, int(used_per_node[row]), int(tie[row]), j, row))
    if not sources:
        return None
    sources.sort()

    before = free_gpus(snapshot)
    frag_before = cluster_fragmentation_milli(snapshot, profile) if profile is not None else None
    busy_rows = np.zeros(len(snapshot), dtype=bool)
    for name in busy:
        row = snapshot.index.get(name)
        if row is not None:
            busy_rows[row] = True
    tried = 0
    for _, _, _, j, row in sources[:max_sources]:
        tried += 1
        found = _empty(snapshot, row, j, on_gpu[(row, j)], policy, busy_rows)
        if found is None:
            continue
        after = moved(snapshot, found)
        if overcommitted(after):  # place_movers accounted each move: cannot happen, but never plan one
            continue
        gained = free_gpus(after)
        frag_after = cluster_fragmentation_milli(after, profile) if profile is not None else None
        if gained <= before or (frag_before is not None and frag_after is not None and frag_after > frag_before):
            continue  # nothing to gain this way
        node_freed = bool(free_gpu_mask(after)[row][after.gpu_usable[row]].all())
        return Gathering(snapshot.node_names[row], j, found, before, gained, frag_before, frag_after, node_freed,
                         tried)
    return None


def _empty(snapshot: ClusterSnapshot, row: int, gpu: int, tenants: list[Movable], policy: Policy,
           busy_rows: np.ndarray) -> tuple[Move, ...] | None:
    """Destinations for every tenant of GPU ``gpu`` of node ``row`` on other partly used GPUs, or None."""
    spec = snapshot.nodes[row]
    memory = {t.pod.uid: memory_held_mib(t.pod.placement, spec) for t in tenants}
    work = snapshot.copy()
    for t in tenants:
        work.release(t.pod.request, t.pod.placement)
    # partly used before the plan: a GPU whole free now never takes a tenant, nor does the source
    partly = snapshot.gpu_usable & ~free_gpu_mask(snapshot)
    partly[row, gpu] = False
    partly[busy_rows] = False

    def destination_of(after: ClusterSnapshot, m: Movable) -> Placement | None:
        state = CycleState(after, m.pod.request, None)
        nodes, _ = feasible_nodes(state, policy)
        if not nodes.size:
            return None
        ok = state.eligible[nodes] & partly[nodes]
        if not ok.any():
            return None
        milli, mem = state.gpu_take
        rows, gpus = np.nonzero(ok)
        node_rows = nodes[rows]
        left = after.free_milli[node_rows, gpus] - milli[node_rows, gpus]
        in_use = (after.gpu_usable[node_rows] & (after.free_milli[node_rows] < MILLI)).sum(axis=1)
        best = int(np.lexsort((gpus, after.tie_rank[node_rows], -in_use, left))[0])  # last key first
        n, g = int(node_rows[best]), int(gpus[best])
        return Placement(after.node_names[n], (g,), int(milli[n, g]), int(mem[n, g]))

    return place_movers(work, tenants, memory, destination_of)
