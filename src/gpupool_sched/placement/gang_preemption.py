"""Gang preemption: which lower-priority pods to evict so that a gang's minimum fits together.

A gang that does not fit may preempt as one pod would, but for all its members at once: nothing is
evicted unless ``need`` members then fit together (evicting for half a gang frees room it cannot use).
Volcano's preempt action does the same for a job's minAvailable.

Pure, like ``place_gang``: members are taken largest first; each one goes where ``decide()`` puts it
on the snapshot as it stands, and where it fits nowhere ``plan_preemption`` picks its victims among
the pods not yet chosen. The victims are then released and the member assumed on the scratch snapshot,
so the next member sees the gang's earlier members in place and their victims gone. Everything is
undone before returning: the snapshot is as it was. PodDisruptionBudgets are counted down across the
members: what earlier members' victims took of a budget is spent for the later ones (``spend``), so a
budget allowing one disruption is not counted once per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.candidates import CandidateBudget
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gang import gang_order
from gpupool_sched.placement.preemption import RunningPod, plan_preemption, spend


@dataclass(frozen=True, slots=True)
class MemberPlan:
    """Member ``member`` (an index into the members given) goes to ``placement`` once ``victims`` (on
    that node, most important first) are gone; no victims: it fits as things are."""

    member: int
    placement: Placement
    victims: tuple[RunningPod, ...]


@dataclass(frozen=True, slots=True)
class GangPreemption:
    """``need`` members placed together, with the victims each needs. ``pdb_violations``: victims a
    PodDisruptionBudget protects (the caller then evicts nobody, as for a single pod)."""

    members: tuple[MemberPlan, ...]
    pdb_violations: int
    considered: int = field(default=0, compare=False)  # nodes the members' searches tried, summed

    @property
    def victims(self) -> tuple[RunningPod, ...]:
        return tuple(v for m in self.members for v in m.victims)


def plan_gang_preemption(
    snapshot: ClusterSnapshot,
    members: Sequence[PodRequest],
    need: int,
    priority: int,
    running: Sequence[RunningPod],
    policy: Policy,
    rng: np.random.Generator | None = None,
    budget: CandidateBudget | None = None,
) -> GangPreemption | None:
    """Victims among ``running`` (pods of any priority accounted on ``snapshot``; only those of strictly
    lower ``priority`` are taken) that let ``need`` of ``members`` fit together, or None when even that
    would not make room. A result without victims means the gang fits as things are. ``budget``: each
    member's search, as ``plan_preemption``'s."""
    if not 1 <= need <= len(members):
        raise ValueError(f"a gang of {len(members)} member(s) cannot need {need} at once")
    left = {p.uid: p for p in running if p.priority < priority}
    undo: list[tuple[str, PodRequest, Placement]] = []  # ("assume" | "release", ...) to reverse
    planned: list[MemberPlan] = []
    violations = considered = 0
    spent: dict[str, int] = {}  # disruptions the victims so far took of each budget
    try:
        order = gang_order(members)
        for pos, i in enumerate(order):
            if len(planned) == need:
                break
            request = members[i]
            decision = decide(snapshot, request, policy, rng)
            if isinstance(decision, Placement):
                victims: tuple[RunningPod, ...] = ()
            else:
                preemption = plan_preemption(snapshot, request, priority, list(left.values()), policy, rng,
                                             spent=spent, budget=budget)
                if preemption is None:  # fits nowhere even with every lower pod gone: the others may do
                    if len(planned) + len(order) - pos - 1 < need:
                        return None
                    continue
                victims, decision = preemption.victims, preemption.placement
                violations += preemption.pdb_violations
                considered += preemption.considered
                spent = spend(victims, spent)
                for victim in victims:
                    del left[victim.uid]
                    snapshot.release(victim.request, victim.placement)
                    undo.append(("release", victim.request, victim.placement))
            snapshot.assume(request, decision)
            undo.append(("assume", request, decision))
            planned.append(MemberPlan(i, decision, victims))
    finally:
        for kind, request, placement in reversed(undo):
            if kind == "assume":
                snapshot.release(request, placement)
            else:
                snapshot.assume(request, placement)
    if len(planned) < need:
        return None
    return GangPreemption(tuple(planned), violations, considered)
