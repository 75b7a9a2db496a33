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
import math
import time
from dataclasses import dataclass

from gpupool_sched.cache.entries import Phase, PodEntry
from gpupool_sched.cache.nominator import Nominator
from gpupool_sched.kube.migration_record import MovedMark, RecordedMove, encode_moved
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
    blocked: str  # UID of the pod the migration makes room for (background consolidation: its `background/` id)
    deadline: float  # state clock
    adopted: bool = False  # read from the blocked pod's migration record, not decided by this instance
    at: float = 0.0  # wall-clock seconds: when the hold was taken (the move, for the cooldown and budget)


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
        if reservation_uid(mover.uid) in self.pods:
            raise ValueError(f"pod {mover.key} already has a reservation")
        return self._hold(Reservation(reservation_uid(mover.uid), mover.uid, mover.key, mover.owner, mover.request,
                                      destination, blocked, self.clock() + timeout_s, at=time.time()))

    def adopt_reservation(self, blocked: str, move: RecordedMove, since: float, deadline: float) -> Reservation | None:
        """Hold what another instance held for `move`'s replacement (the blocked pod's migration record, whose
        holds were taken at `since`, wall-clock seconds): a standby mirrors the leader, a new leader takes
        the holds over. None when there is nothing to hold: held already (an adopted hold lasts until the
        later `deadline`: a surge extends the record), the destination unknown, the replacement already
        placed there, or the room taken."""
        uid = reservation_uid(move.mover)
        held = self.reservations.get(uid)
        if held is not None and held.adopted:
            held.deadline = max(held.deadline, deadline)
        if uid in self.pods or move.destination.node not in self.nodes or deadline <= self.clock():
            return None
        if self._replacement_on(move.destination.node, move.owner, move.request, move.mover, since) is not None:
            return None
        if not self.snapshot.fits(move.request, move.destination):
            log.warning("not holding %s for the replacement of %s: the room is taken", move.destination.node,
                        move.mover_key)
            return None
        log.info("holding %s for the replacement of %s (adopted migration)", move.destination.node, move.mover_key)
        return self._hold(Reservation(uid, move.mover, move.mover_key, move.owner, move.request, move.destination,
                                      blocked, deadline, adopted=True, at=since))

    def _hold(self, reservation: Reservation) -> Reservation:
        namespace = reservation.mover_key.partition("/")[0]
        entry = PodEntry(reservation.uid, f"{namespace}/reserved for the replacement of {reservation.mover_key}",
                         reservation.destination.node, reservation.request, reservation.destination, Phase.RESERVED,
                         True, self.clock(), owner=reservation.owner)
        self.pods[reservation.uid] = entry
        self.by_node[reservation.destination.node].add(reservation.uid)
        self._tell(entry)
        self._apply(entry)
        self.reservations[reservation.uid] = reservation
        return reservation

    def _replacement_on(self, node: str, owner: str, request: PodRequest, mover: str, since: float) -> PodEntry | None:
        """A placed pod on `node` that is the replacement of `mover`: same controller, same request, started
        since `since` (its siblings started before; API timestamps have whole seconds)."""
        for uid in self.by_node.get(node, ()):
            entry = self.pods[uid]
            if (uid != mover and entry.phase not in (Phase.RESERVED, Phase.NOMINATED) and entry.owner == owner
                    and entry.started >= math.floor(since) and same_request(entry.request, request)):
                return entry
        return None

    def replacement_seen(self, entry: PodEntry) -> bool:
        """A pod another instance placed showed up bound: when it is the replacement a reservation waits for
        (a standby's mirror of the leader's), the reservation ends before it is accounted. True if so."""
        if not entry.owner or not self.reservations:
            return False
        for r in list(self.reservations.values()):
            if (r.destination.node == entry.node and r.owner == entry.owner and r.mover != entry.uid
                    and same_request(r.request, entry.request)):
                self.replaced[entry.uid] = self.replaced.get(r.mover, r.mover)
                self.end_reservation(r.uid)
                return True
        return False

    def abandon_unstarted(self) -> list[Reservation]:
        """Adopted reservations whose mover still runs and is not being evicted: the instance that planned
        them is gone and will not evict it, so nothing will replace it (call when leading)."""
        unstarted = [r for r in self.reservations.values()
                     if r.adopted and (e := self.pods.get(r.mover)) is not None and e.evicting_for is None
                     and e.phase in (Phase.BOUND, Phase.CONFIRMED)]
        for r in unstarted:
            log.info("migration for %s: %s was not evicted before the failover; its hold ends", r.blocked,
                     r.mover_key)
            self.end_reservation(r.uid)
        return unstarted

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
            lineage = self.replaced.get(reservation.mover, reservation.mover)
            self.replaced[replacement] = lineage
            # the Binding carries it onto the pod: the cooldown and the budget outlive this process
            self.marks[replacement] = encode_moved(MovedMark(reservation.at or time.time(), reservation.mover,
                                                             lineage, reservation.mover_key, reservation.owner))
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

    def extend_adopted(self, blocked: str, deadline: float) -> None:
        """An adopted nomination of a pod whose migration record holds until `deadline` (state clock) lasts
        that long (a surge's holds outlast an eviction's)."""
        nomination = self.nominations.get(blocked)
        if nomination is not None and nomination.adopted:
            nomination.deadline = max(nomination.deadline, deadline)

    def migrating_nodes(self) -> set[str]:
        """Nodes a migration is under way on: a reservation's destination, or a mover's node while the pod
        the migration makes room for waits, or both ends of a surge until it is over (at most one migration
        at a time per node)."""
        nodes = {r.destination.node for r in self.reservations.values()}
        for r in self.reservations.values():  # the node a mover marked for it leaves, while the mover is there
            mover = self.pods.get(r.mover)  # (a background move nominates nobody: this is its source)
            if mover is not None and mover.evicting_for == r.blocked:
                nodes.add(mover.node)
        for source, destination in self.surging.values():
            nodes.update((source, destination))
        blocked = {r.blocked for r in self.reservations.values()}
        for uid in blocked:
            nomination = self.nominations.get(uid)
            if nomination is not None:
                nodes.add(nomination.node)
        return nodes
