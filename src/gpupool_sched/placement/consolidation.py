"""Consolidation, the decision: which running pods to move, and where, so that a pod that fits nowhere
fits. Pure, like ``plan_preemption``: the scheduler's consolidate action and the simulator call the same
function and carry out its answer themselves (reservations, then the Eviction API).

Moving is cheaper than killing, so it is tried before preemption, and it never moves a pod of higher
priority than the blocked one. Only the ``movable`` pods the caller passes are candidates (owned by a
controller that recreates them, or opted in; old enough; not in a gang; see docs/defragmentation.md).

* Per node, every movable pod is taken out; if the blocked pod then fits there (the policy's own filter
  chain, as ``decide()`` asks), they are put back one at a time, the most costly to move first (most
  GPU memory held, then the longest running), each kept if the pod still fits. What cannot be kept
  are the node's movers. Nodes with more than ``max_movers`` movers are dropped.
* Every mover must have a destination in the same plan (KAI's rule): on a copy where the movers are
  gone and the blocked pod is placed, each mover, largest first, is placed by ``decide()`` on another
  node, else on another GPU of the same node (shares gathered to free a whole GPU), never on a ``busy``
  node (a migration already under way there) nor back on its own devices; a node whose movers cannot
  all be re-placed is no plan.
* Among the nodes with a complete plan: fewest movers, then least GPU memory moved, then fewest distinct
  owners, then the snapshot's tie order. Nodes are tried in that order and the first complete plan wins,
  so the cost is one re-placement per node tried, not per node of the cluster.

Work is batched as in ``plan_preemption``: one working copy, every candidate node's movable pods taken
out at once, one vectorised filter pass per put-back step over all nodes. Candidates are sampled as
there (``CandidateBudget``: 10 % of the nodes past the cheap bound, at least 100).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.constraints import NODE_NAME_FIELD, Requirement
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.candidates import CandidateBudget, start_offset
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.nodeaffinity import pinned, with_requirement
from gpupool_sched.placement.preemption import (
    RunningPod,
    _bound,
    fit_mask,
    mig_slice_milli,
)

DEFAULT_MAX_MOVERS = 16
_PLANS_TRIED = 8  # nodes whose movers are re-placed before giving up (each costs one decide() per mover)


@dataclass(frozen=True, slots=True)
class Movable:
    """A running pod the caller allows to move: ``owner`` is what recreates it (e.g. ``ReplicaSet/ns/name``;
    the replacement is recognised by it and the shape) and counts distinct owners in a plan."""

    pod: RunningPod
    owner: str


@dataclass(frozen=True, slots=True)
class Move:
    """Evict ``pod``; its replacement goes to ``destination`` (held for it before the eviction)."""

    pod: RunningPod
    owner: str
    destination: Placement
    memory_mib: int  # GPU memory the pod holds on its node now


@dataclass(frozen=True, slots=True)
class Consolidation:
    """Move ``moves`` away from ``node``; the blocked pod then goes to ``placement`` there."""

    node: str
    placement: Placement
    moves: tuple[Move, ...]
    considered: int = field(default=0, compare=False)  # nodes whose movable pods were taken out

    @property
    def memory_moved_mib(self) -> int:
        return sum(m.memory_mib for m in self.moves)

    @property
    def owners(self) -> int:
        return len({m.owner for m in self.moves})


def memory_held_mib(placement: Placement, spec: NodeSpec) -> int:
    """GPU memory a pod placed at ``placement`` holds: whole GPUs all of theirs, shares their share, MIG
    devices their part of their GPU."""
    total = 0
    for part in placement.parts():
        for j in part.gpu_indices:
            memory = spec.gpus[j].memory_mib if j < len(spec.gpus) else 0
            total += memory if part.gpu_milli == MILLI else part.gpu_memory_mib
        if part.mig_devices:
            slices = {s.uuid: (s.profile, g) for g in spec.gpus for s in g.mig_slices}
            for uuid in part.mig_devices:
                if uuid in slices:
                    profile, gpu = slices[uuid]
                    total += mig_slice_milli(profile, gpu) * gpu.memory_mib // MILLI
    return total


def away_from(request: PodRequest, nodes: Sequence[str]) -> PodRequest:
    """``request`` kept off ``nodes`` (a node-name NotIn requirement, `with_requirement`)."""
    if not nodes:
        return request
    return with_requirement(request, Requirement(NODE_NAME_FIELD, "NotIn", tuple(sorted(set(nodes)))))


@dataclass(slots=True)
class _NodePlan:
    row: int
    order: list[Movable]  # put-back order, most costly to move first
    memory: dict[str, int]
    movers: list[Movable] = field(default_factory=list)

    def key(self, tie_rank: int) -> tuple[int, int, int, int]:
        return (len(self.movers), sum(self.memory[m.pod.uid] for m in self.movers),
                len({m.owner for m in self.movers}), tie_rank)


def plan_consolidation(
    snapshot: ClusterSnapshot,
    request: PodRequest,
    priority: int,
    movable: Sequence[Movable],
    policy: Policy,
    rng: np.random.Generator | None = None,
    *,
    max_movers: int = DEFAULT_MAX_MOVERS,
    busy: frozenset[str] = frozenset(),
    budget: CandidateBudget | None = None,
) -> Consolidation | None:
    """Where ``request`` (of ``priority``) can run once some of ``movable`` (pods accounted on
    ``snapshot``) move elsewhere, and where each goes; None when no plan of at most ``max_movers`` moves
    exists. Pods of higher priority than ``priority``, pods on ``busy`` nodes and pods on nodes the
    snapshot lacks are not moved; ``busy`` nodes take no replacement either. ``snapshot`` is not
    modified. Call it for a pod that fits nowhere; a UID given twice is a ValueError."""
    if max_movers < 1:
        raise ValueError(f"max_movers must be at least 1, got {max_movers}")
    seen: set[str] = set()
    by_row: dict[int, list[Movable]] = defaultdict(list)
    for m in movable:
        if m.pod.uid in seen:
            raise ValueError(f"movable pod {m.pod.uid} is given twice")
        seen.add(m.pod.uid)
        row = snapshot.index.get(m.pod.node)
        if row is not None and m.pod.priority <= priority and m.pod.node not in busy:
            by_row[row].append(m)
    if not by_row:
        return None

    work = snapshot.copy()
    rows = _bound(work, request, {r: [m.pod for m in ms] for r, ms in by_row.items()})
    budget = budget or CandidateBudget()
    want = budget.count(len(rows))
    if want < len(rows):
        start = start_offset(request.name, len(rows), rng)
        rows = rows[start:] + rows[:start]
    plans: dict[int, _NodePlan] = {}
    tried = 0
    while tried < len(rows) and len(plans) < want:
        chunk = rows[tried:tried + max(want - len(plans), 16)]
        tried += len(chunk)
        fresh = [_take_out(work, row, by_row[row]) for row in chunk]
        fits = fit_mask(work, request, policy)
        plans.update((p.row, p) for p in fresh if fits[p.row])
    if not plans:
        return None

    # put back, one step for every node at once: where the pod no longer fits, the pod is a mover
    for step in range(max(len(p.order) for p in plans.values())):
        trying = [(p, p.order[step]) for p in plans.values() if step < len(p.order)]
        for _, m in trying:
            work.assume(m.pod.request, m.pod.placement)
        fits = fit_mask(work, request, policy)
        for p, m in trying:
            if not fits[p.row]:
                work.release(m.pod.request, m.pod.placement)
                p.movers.append(m)

    ranked = sorted((p for p in plans.values() if len(p.movers) <= max_movers),
                    key=lambda p: p.key(int(snapshot.tie_rank[p.row])))
    for p in ranked[:_PLANS_TRIED]:
        found = _replace_movers(snapshot, request, p, policy, rng, busy, tried)
        if found is not None:
            return found
    return None


def _take_out(work: ClusterSnapshot, row: int, pods: list[Movable]) -> _NodePlan:
    spec = work.nodes[row]
    memory = {m.pod.uid: memory_held_mib(m.pod.placement, spec) for m in pods}
    order = sorted(pods, key=lambda m: mover_order(m, memory))
    for m in order:
        work.release(m.pod.request, m.pod.placement)
    return _NodePlan(row, order, memory)


def same_devices(a: Placement, b: Placement) -> bool:
    """``a`` and ``b`` take the same node and devices (a move there would move nothing)."""
    return all(x.node == y.node and x.gpu_indices == y.gpu_indices and x.mig_devices == y.mig_devices
               for x, y in zip(a.parts(), b.parts(), strict=False)) and len(a.parts()) == len(b.parts())


def mover_order(m: Movable, memory: dict[str, int]) -> tuple[int, float, str]:
    """Movers are re-placed the most costly first: most GPU memory held, then the longest running."""
    return (-memory[m.pod.uid], m.pod.start_time, m.pod.uid)


def place_movers(after: ClusterSnapshot, movers: Sequence[Movable], memory: dict[str, int],
                 destination_of: Callable[[ClusterSnapshot, Movable], Placement | None]) -> tuple[Move, ...] | None:
    """Give every mover a destination on ``after`` (the movers already taken out), the most costly first,
    each accounted there before the next is placed (KAI's rule: all or none). ``destination_of`` answers
    for one mover; a mover without a destination, or sent back onto its own devices, is None for the
    whole set. ``after`` is modified (the destinations assumed) whatever the answer."""
    moves: list[Move] = []
    for m in sorted(movers, key=lambda m: mover_order(m, memory)):
        destination = destination_of(after, m)
        if destination is None or same_devices(destination, m.pod.placement):
            return None
        after.assume(m.pod.request, destination)
        moves.append(Move(m.pod, m.owner, destination, memory[m.pod.uid]))
    return tuple(moves)


def _replace_movers(snapshot: ClusterSnapshot, request: PodRequest, plan: _NodePlan, policy: Policy,
                    rng: np.random.Generator | None, busy: frozenset[str], considered: int) -> Consolidation | None:
    """The plan for ``plan``'s node when every mover has a destination; None otherwise."""
    node = snapshot.node_names[plan.row]
    after = snapshot.copy()
    for m in plan.movers:
        after.release(m.pod.request, m.pod.placement)
    placement = decide(after, pinned(request, node), policy, rng)
    if not isinstance(placement, Placement):  # fit_mask said it fits: decide() asks the same question
        raise AssertionError(f"pod {request.name}: no placement on {node} after moving its movers")
    after.assume(request, placement)

    def destination_of(work: ClusterSnapshot, m: Movable) -> Placement | None:
        found = decide(work, away_from(m.pod.request, sorted({node, *busy})), policy, rng)
        if not isinstance(found, Placement):  # elsewhere on the same node (whole GPUs freed by shares)
            found = decide(work, away_from(m.pod.request, sorted(busy)), policy, rng)
        return found if isinstance(found, Placement) else None

    moves = place_movers(after, plan.movers, plan.memory, destination_of)
    return None if moves is None else Consolidation(node, placement, moves, considered)


def overcommitted(snapshot: ClusterSnapshot) -> bool:
    """Something on ``snapshot`` is accounted beyond what it has (a GPU, CPU, memory or pod slots)."""
    usable = snapshot.gpu_usable
    return not bool((snapshot.free_milli[usable] >= 0).all() and (snapshot.gpu_mem_free[usable] >= 0).all()
                    and (snapshot.cpu_free >= 0).all() and (snapshot.mem_free >= 0).all()
                    and (snapshot.pods_free >= 0).all())


def moved(snapshot: ClusterSnapshot, moves: Sequence[Move]) -> ClusterSnapshot:
    """A copy of ``snapshot`` with ``moves`` carried out: each mover released, then each placed at its
    destination (assume() raises for a destination the node does not have)."""
    after = snapshot.copy()
    for move in moves:
        after.release(move.pod.request, move.pod.placement)
    for move in moves:
        after.assume(move.pod.request, move.destination)
    return after


def still_fits(snapshot: ClusterSnapshot, request: PodRequest, found: Consolidation) -> bool:
    """``found`` can be carried out on ``snapshot`` as it is now (a plan computed on an older copy): with
    its movers gone, the pod and every replacement placed where the plan says, nothing is overcommitted."""
    after = moved(snapshot, found.moves)
    after.assume(request, found.placement)
    return not overcommitted(after)
