"""Allocate: place the job as things are. A lone pod gets the placement core's `decide` (nodes whose
handshake gate is busy for its shapes last); a gang gets `place_gang` (at least `need` members together,
or none). The members' own holds, and those of less important preemptors, are theirs for the decision
(released through the statement, which settles or restores them); so is the destination a migration
reserved for a replacement pod (`cache/reservations.py`)."""

from __future__ import annotations

import time

import numpy as np

from gpupool_sched.cache.entries import plan_shapes
from gpupool_sched.framework.session import Outcome, Session, Steps
from gpupool_sched.framework.statement import Statement
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import NodeSample, decide
from gpupool_sched.placement.gang import GangUnschedulable, place_gang

NAME = "allocate"


def run(session: Session) -> Steps[Outcome | None]:
    yield from ()
    state = session.state
    with Statement(state) as statement:
        statement.release_holds(session.plans)
        snapshot = state.snapshot
        # scan in tie-break order from the first node each time: docs/benchmarks.md shows a rotating
        # start costs FGD 1.5 points of allocation on openb, a fixed one nothing measurable
        sampler = session.sampler.follow(snapshot) if session.sampler is not None else None
        start = time.perf_counter()
        if session.gang:
            out = place_gang(snapshot, [p.request for p in session.plans], session.need, session.policy,
                             session.rng, sample=sampler)
            session.seconds += time.perf_counter() - start
            if isinstance(out, GangUnschedulable):
                session.unschedulable = out
                return None  # discarded: every released hold is accounted again
            for i, placement in out.placements:
                statement.assume(session.plans[i], placement)  # ends that member's nomination: its holds went
        else:
            plan = session.plans[0]
            sample: NodeSample | None = sampler
            busy = state.gate_busy(plan_shapes(plan))
            if busy:
                sample = open_gates_first(snapshot, busy, sampler)
            reservation = state.reservation_for(plan)
            if reservation is not None:  # a mover's replacement: its destination first
                statement.claim(plan, reservation.uid)
                sample = destination_first(snapshot, reservation.destination.node, sample)
            start = time.perf_counter()
            decision = decide(snapshot, plan.request, session.policy, session.rng, sample=sample)
            session.seconds += time.perf_counter() - start
            if isinstance(decision, Unschedulable):
                session.unschedulable = decision
                return None
            if reservation is not None and decision.node == reservation.destination.node:
                decision = reserved_devices(snapshot, plan.request, reservation.destination, decision)
            statement.assume(plan, decision)
        statement.commit()
    return Outcome(statement)


def reserved_devices(snapshot: ClusterSnapshot, request: PodRequest, reserved: Placement,
                     decided: Placement) -> Placement:
    """The devices the reservation held, when they still fit, rather than the policy's pick on that node:
    on the mover's own node another GPU may be the one the blocked pod waits for."""
    return reserved if snapshot.fits(request, reserved) else decided


def destination_first(snapshot: ClusterSnapshot, node: str, then: NodeSample | None) -> NodeSample:
    """Only the reserved node when it is feasible (the replacement lands on the room held for it), else
    the usual sample (the room is gone: it goes where it fits, and the reservation ends)."""
    row = snapshot.index.get(node)

    def sample(candidates: np.ndarray) -> np.ndarray:
        if row is not None and (candidates == row).any():
            return np.array([row], dtype=np.int64)
        return then(candidates) if then is not None else candidates

    return sample


def open_gates_first(snapshot: ClusterSnapshot, busy: set[str], then: NodeSample | None) -> NodeSample:
    """Drop feasible nodes whose handshake gate is taken for the pod's shapes unless no other node
    is feasible: a pod placed there would wait for the previous pod's ack before its Binding goes
    out. Packing policies put consecutive same-shape pods on one node, so without this the binds
    of a burst go out one ack after another (docs/scheduler.md, "The gate and throughput")."""
    rows = np.fromiter((r for n in busy if (r := snapshot.index.get(n)) is not None), dtype=np.int64)

    def sample(candidates: np.ndarray) -> np.ndarray:
        if rows.size:
            free = candidates[~np.isin(candidates, rows)]
            if free.size:
                candidates = free
        return then(candidates) if then is not None else candidates

    return sample
