"""Migration's marks on the ledger: the destination of every mover, held for its replacement before the
mover is evicted (a RESERVED entry under a synthetic UID, accounted on the destination's devices), and
the nodes a migration is under way on.

A replacement is the pod its controller creates after the eviction: recognised by the same controller
(`PodPlan.owner`) and the same request (GPU shapes, CPU, memory, namespace). Its decision claims the
reservation through its Statement (released for the decision, dropped once it is placed there, accounted
again otherwise). A reservation ends when claimed, when it expires, or when the migration is abandoned
(the blocked pod gone before its movers were evicted)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpupool_sched.cache.entries import Phase, PodEntry
from gpupool_sched.cache.nominator import Nominator
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    uid: str  # the RESERVED entry's synthetic UID
    mover: str  # UID of the pod that moves
    mover_key: str
    owner: str  # its controller: the replacement has the same
    request: PodRequest  # what the mover asks: the replacement asks the same
    destination: Placement
    blocked: str  # UID of the pod the migration makes room for
    deadline: float  # state clock


def reservation_uid(mover: str) -> str:
    """The synthetic ledger UID of the reservation made for the mover `mover` (a UID)."""
    return f"reserve/{mover}"


def same_request(a: PodRequest, b: PodRequest) -> bool:
    """A replacement asks what the pod it replaces asked (its name differs)."""
    return (a.gpu_shapes() == b.gpu_shapes() and a.cpu_milli == b.cpu_milli and a.memory_mib == b.memory_mib
            and a.namespace == b.namespace and a.gpu_models == b.gpu_models)


class Reservations(Nominator):
    def reserve(self, blocked: str, mover: PodEntry, destination: Placement, timeout_s: float) -> Reservation:
        """Hold `destination` for `mover`'s replacement (accounted at once)."""
        uid = reservation_uid(mover.uid)
        if uid in self.pods:
            raise ValueError(f"pod {mover.key} already has a reservation")
        namespace = mover.key.partition("/")[0]
        entry = PodEntry(uid, f"{namespace}/reserved for the replacement of {mover.key}", destination.node,
                         mover.request, destination, Phase.RESERVED, True, self.clock(), owner=mover.owner)
        self.pods[uid] = entry
        self.by_node[destination.node].add(uid)
        self._tell(entry)
        self._apply(entry)
        reservation = Reservation(uid, mover.uid, mover.key, mover.owner, mover.request, destination, blocked,
                                  self.clock() + timeout_s)
        self.reservations[uid] = reservation
        return reservation

    def reservation_for(self, plan: PodPlan) -> Reservation | None:
        """The reservation `plan` replaces a mover of, if any (its controller, its request; the oldest)."""
        if not plan.owner:
            return None
        found = [r for r in self.reservations.values()
                 if r.owner == plan.owner and r.mover != plan.uid and same_request(r.request, plan.request)]
        return min(found, key=lambda r: (r.deadline, r.uid)) if found else None

    def release_reservation(self, uid: str) -> bool:
        """Un-account a reservation for one decision (its claimant's); `end_reservation` or
        `restore_reservation` settles it."""
        entry = self.pods.get(uid)
        if entry is None or uid not in self.reservations:
            return False
        self._unapply(entry)
        return True

    def restore_reservation(self, uid: str) -> None:
        entry = self.pods.get(uid)
        if entry is not None and uid in self.reservations:
            self._apply(entry)

    def end_reservation(self, uid: str) -> bool:
        """Drop a reservation (claimed, expired or abandoned); True when that freed resources."""
        if self.reservations.pop(uid, None) is None:
            return False
        entry = self._unlink(uid)
        if entry is None:
            return False
        freed = entry.applied
        self._unapply(entry)
        return freed

    def claimed(self, uid: str, replacement: str) -> None:
        """`replacement` was placed for the reservation `uid`: it ends, and the replacement inherits its
        mover's history (a cooldown follows the pod from one node to the next)."""
        reservation = self.reservations.get(uid)
        if reservation is not None:
            self.replaced[replacement] = self.replaced.get(reservation.mover, reservation.mover)
            self.end_reservation(uid)
            self.on_claimed(reservation)

    def abandon_migration(self, blocked: str) -> bool:
        """The blocked pod is gone: its migration's reservations end and movers not yet evicted are spared
        (those already going: their replacements are scheduled as any new pod). True when room was freed."""
        freed = False
        for r in [r for r in self.reservations.values() if r.blocked == blocked]:
            freed |= self.end_reservation(r.uid)
        return freed

    def expire_reservations(self) -> list[Reservation]:
        """Reservations past their deadline, ended (the replacement never came, or came elsewhere)."""
        now = self.clock()
        stale = [r for r in self.reservations.values() if r.deadline <= now]
        for r in stale:
            log.info("reservation on %s for the replacement of %s expired", r.destination.node, r.mover_key)
            self.end_reservation(r.uid)
        return stale

    def extend_migration(self, blocked: str, mover: str, seconds: float) -> None:
        """A surge takes longer than an eviction (the new replica must become Ready before the mover goes):
        the blocked pod's nomination and the mover's reservation last at least `seconds` more."""
        until = self.clock() + seconds
        nomination = self.nominations.get(blocked)
        if nomination is not None:
            nomination.deadline = max(nomination.deadline, until)
        reservation = self.reservations.get(reservation_uid(mover))
        if reservation is not None:
            reservation.deadline = max(reservation.deadline, until)

    def migrating_nodes(self) -> set[str]:
        """Nodes a migration is under way on: a reservation's destination, or a mover's node while the pod
        the migration makes room for waits, or both ends of a surge until it is over (at most one migration
        at a time per node)."""
        nodes = {r.destination.node for r in self.reservations.values()}
        for source, destination in self.surging.values():
            nodes.update((source, destination))
        blocked = {r.blocked for r in self.reservations.values()}
        for uid in blocked:
            nomination = self.nominations.get(uid)
            if nomination is not None:
                nodes.add(nomination.node)
        return nodes
