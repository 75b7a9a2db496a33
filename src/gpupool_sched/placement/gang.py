"""Gang placement: a gang's minimum number of members fits together, or none of it is placed.

Coscheduling (the scheduler-plugins PodGroup convention: ``minMember``) in the placement core, pure:
the members are placed one after the other with ``decide()``, each placement tentatively accounted on
the snapshot so that the next member sees it, and every tentative placement is released before the
function returns: the caller gets the placements (to assume and bind together) or the reason the gang
does not fit, and the snapshot is as it was. Because nothing is held while a gang waits, two gangs that
each need two thirds of the cluster cannot deadlock: one fits whole, the other holds nothing.

Locality: members go first to nodes the gang already uses (the same node keeps their traffic on NVLink
/ PCIe), else to nodes with room for all the gang's remaining whole GPUs, else wherever the policy
puts them. Largest members are placed first (bin packing's first-fit decreasing), so a big member is
not left without a node by small ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.decide import NodeSample, decide
from gpupool_sched.placement.framework import Policy


@dataclass(frozen=True, slots=True)
class GangPlacement:
    """Where each placed member goes: (index into the members given, placement), in placement order.
    At least ``need`` members; more when more fit."""

    placements: tuple[tuple[int, Placement], ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({p.node for _, p in self.placements}))


@dataclass(frozen=True, slots=True)
class GangUnschedulable:
    """Fewer than ``need`` members fit together. ``member`` (an index into the members) is the first that
    found no node, ``unschedulable`` why; ``placed`` members had fit before it."""

    need: int
    placed: int
    member: int
    unschedulable: Unschedulable

    @property
    def message(self) -> str:
        return (f"gang does not fit: {self.placed} of the {self.need} members it needs at once fit "
                f"together; next: {self.unschedulable.message}")


def _whole_gpus(request: PodRequest) -> int:
    """Whole GPUs the request takes (its shares and MIG devices do not count)."""
    whole = request.gpu_count if request.is_whole else 0
    return whole + sum(s.gpu_count for s in request.extra if s.is_whole)


def _size(request: PodRequest) -> tuple[int, int, int]:
    return (_whole_gpus(request), request.gpu_milli_total if request.wants_gpu else 0, request.cpu_milli)


def gang_order(members: Sequence[PodRequest]) -> list[int]:
    """Indices of ``members``, largest first (first-fit decreasing)."""
    return sorted(range(len(members)), key=lambda i: _size(members[i]), reverse=True)


def _prefer(snapshot: ClusterSnapshot, used: set[str], rest_whole: int, then: NodeSample | None) -> NodeSample:
    """Feasible nodes narrowed to the gang's own nodes, else to nodes with ``rest_whole`` free whole GPUs."""
    rows = np.fromiter((snapshot.index[n] for n in used if n in snapshot.index), dtype=np.int64)

    def sample(candidates: np.ndarray) -> np.ndarray:
        if rows.size:
            mine = candidates[np.isin(candidates, rows)]
            if mine.size:
                return mine
        if rest_whole > 1:
            free = ((snapshot.free_milli[candidates] == MILLI) & snapshot.gpu_usable[candidates]).sum(axis=1)
            roomy = candidates[free >= rest_whole]
            if roomy.size:
                candidates = roomy
        return then(candidates) if then is not None else candidates

    return sample


def place_gang(
    snapshot: ClusterSnapshot,
    members: Sequence[PodRequest],
    need: int,
    policy: Policy,
    rng: np.random.Generator | None = None,
    *,
    sample: NodeSample | None = None,
) -> GangPlacement | GangUnschedulable:
    """Place at least ``need`` of ``members`` together (all that fit, largest first), or none.

    The snapshot is used as scratch (members assumed one by one) and restored before returning."""
    if not 1 <= need <= len(members):
        raise ValueError(f"a gang of {len(members)} member(s) cannot need {need} at once")
    order = gang_order(members)
    placed: list[tuple[int, Placement]] = []
    used: set[str] = set()
    rest_whole = sum(_whole_gpus(members[i]) for i in order)
    failed: tuple[int, Unschedulable] | None = None
    try:
        for pos, i in enumerate(order):
            request = members[i]
            decision = decide(snapshot, request, policy, rng, sample=_prefer(snapshot, used, rest_whole, sample))
            rest_whole -= _whole_gpus(request)
            if isinstance(decision, Unschedulable):
                failed = failed or (i, decision)
                if len(placed) + len(order) - pos - 1 < need:
                    break  # the members left cannot make up the minimum
                continue
            snapshot.assume(request, decision)
            placed.append((i, decision))
            used.add(decision.node)
    finally:
        for i, placement in reversed(placed):
            snapshot.release(members[i], placement)
    if len(placed) >= need:
        return GangPlacement(tuple(placed))
    assert failed is not None
    return GangUnschedulable(need, len(placed), failed[0], failed[1])
