"""Every tentative change of one decision, committed or discarded whole (Volcano's Statement).

A decision may release holds (what a preemptor's gone victims freed, kept for it), claim a reservation (a
migration's destination, kept for a mover's replacement), assume placements, mark evictions with a
nomination and reserve destinations for movers. Each is applied to the cluster state at once, so that later steps of
the same decision see it, and recorded here:
  * `commit` settles what was released: a preemptor's own holds went with its placement (`assume` ends
    its nomination) or are accounted again; holds of less important preemptors are dropped on the nodes
    this decision took or nominated a pod to and accounted again elsewhere. On a node it nominated a
    preemptor to, kube-scheduler also clears those lower pods' nominatedNodeName: `displaced` names them
    for the front end to do the same.
    A claimed reservation is dropped when its claimant was placed, else accounted again.
  * `discard` undoes everything: placements forgotten, victims spared, nominations ended, reservations
    made dropped, every released hold and claimed reservation accounted again.
Used as a context manager, a statement not committed when the block ends (an exception included) is
discarded. Nothing but a statement releases, drops or restores holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.held_room import held_room
from gpupool_sched.placement.preemption import Preemption


def free_room(state: ClusterState, plan: PodPlan, preemption: Preemption,
              takes: Sequence[tuple[PodRequest, Placement]] | None = None) -> list[tuple[PodRequest, Placement]]:
    """What `plan`'s preemption counts on beyond its victims' room on its node (`held_room`), on the
    live snapshot: `takes` (default: the preemption's placement of `plan`)."""
    if takes is None:
        takes = [(plan.request, preemption.placement)]
    return held_room(state.snapshot, preemption.node, takes, preemption.victims, f"{plan.key} (free room)",
                     plan.priority, plan.request.namespace)


class Statement:
    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.placements: list[tuple[PodPlan, Placement]] = []
        self.evictions: list[tuple[PodPlan, Preemption]] = []  # victims marked, preemptor nominated
        self.committed = False
        self._closed = False
        self._own_released: list[str] = []  # nominations whose holds were released for their own pod
        self._lower_released: list[str] = []  # nominations of lower priority, released for this decision
        self._claimed: list[tuple[str, str]] = []  # (reservation, claimant UID) released for this decision
        self.reserved: list[str] = []  # reservations made (a migration's destinations)
        self.moving: list[tuple[str, str]] = []  # (background migration, mover) marked without a nomination
        self.displaced: list[str] = []  # committed: lower nominations on a node this decision nominated a preemptor to

    def __enter__(self) -> Statement:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if not self._closed:
            self.discard()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("statement already " + ("committed" if self.committed else "discarded"))

    def release_holds(self, plans: Sequence[PodPlan]) -> None:
        """Un-account, for this decision, the holds of `plans`' own nominations and of every nomination of
        lower priority than all of them: kube-scheduler counts a nominated pod only against pods of its
        priority or lower, so a more important pod may take that room."""
        self._check_open()
        for plan in plans:
            if self.state.release_holds(plan.uid):
                self._own_released.append(plan.uid)
        own = {p.uid for p in plans}
        self._lower_released += self.state.release_lower_holds(min(p.priority for p in plans), own)

    def claim(self, plan: PodPlan, reservation: str) -> None:
        """Un-account, for `plan`'s decision, the reservation it is the replacement for."""
        self._check_open()
        if self.state.release_reservation(reservation):
            self._claimed.append((reservation, plan.uid))

    def reserve(self, blocked: PodPlan, mover: PodEntry, destination: Placement, timeout_s: float) -> None:
        """Hold `destination` for `mover`'s replacement, for `timeout_s` (a migration for `blocked`)."""
        self._check_open()
        self.reserved.append(self.state.reserve(blocked.uid, mover, destination, timeout_s).uid)

    def move(self, purpose: str, mover: PodEntry, destination: Placement, timeout_s: float) -> None:
        """Background consolidation (no pod waits): mark `mover` as evicted for the migration `purpose` and
        hold `destination` for its replacement, for `timeout_s`."""
        self._check_open()
        self.state.mark_moving(purpose, mover.uid)
        self.moving.append((purpose, mover.uid))
        self.reserved.append(self.state.reserve(purpose, mover, destination, timeout_s).uid)

    def assume(self, plan: PodPlan, placement: Placement) -> None:
        """`plan` placed: accounted at once (its nomination, holds included, ends)."""
        self._check_open()
        self.state.assume(plan, placement)
        self.placements.append((plan, placement))

    def evict(self, plan: PodPlan, preemption: Preemption, timeout_s: float,
              room: Sequence[tuple[PodRequest, Placement]] | None = None) -> None:
        """Mark `preemption`'s victims as evicted for `plan` and nominate it on their node (a gang's
        statement does this for each member that needs victims), holding for `timeout_s`. `room`: what
        the plan counts on that is free already, held for `plan` from now on (default: what
        `preemption.placement` takes beyond its victims' room, `held_room`; a gang passes its members'
        on that node to one of them)."""
        self._check_open()
        victims = [v.uid for v in preemption.victims]
        if room is None:
            room = free_room(self.state, plan, preemption)
        self.state.nominate(plan.uid, plan.key, preemption.node, plan.priority, victims, timeout_s, room)
        self.evictions.append((plan, preemption))

    def commit(self) -> None:
        self._check_open()
        placed = {plan.uid for plan, _ in self.placements}
        # kube-scheduler clears the nominations of lower-priority pods on a node it nominates a pod to
        nominated_to = {p.node for _, p in self.evictions}
        taken = {placement.node for _, placement in self.placements} | nominated_to
        for uid in self._own_released:
            if uid not in placed:
                self.state.restore_holds(uid)
        for uid in self._lower_released:
            nomination = self.state.nominations.get(uid)
            if nomination is not None and nomination.node in taken:
                self.state.drop_holds(uid)  # that room went to the more important pod
                if nomination.node in nominated_to:
                    self.displaced.append(uid)
            else:
                self.state.restore_holds(uid)
        for reservation, claimant in self._claimed:
            if claimant in placed:
                self.state.claimed(reservation, claimant)
            else:
                self.state.restore_reservation(reservation)
        self.committed = self._closed = True

    def discard(self) -> None:
        self._check_open()
        self._closed = True
        for plan, _ in reversed(self.placements):
            self.state.forget(plan.uid)
        self.placements.clear()
        for plan, preemption in reversed(self.evictions):
            self.state.spare(plan.uid, (v.uid for v in preemption.victims))
            self.state.end_nomination(plan.uid)
        self.evictions.clear()
        for purpose, mover in reversed(self.moving):
            self.state.spare(purpose, (mover,))
        self.moving.clear()
        for uid in (*self._own_released, *self._lower_released):
            self.state.restore_holds(uid)
        for uid in reversed(self.reserved):
            self.state.end_reservation(uid)
        self.reserved.clear()
        for reservation, _ in self._claimed:
            self.state.restore_reservation(reservation)
