"""Preemption's marks on the ledger: victims being evicted (`PodEntry.evicting_for`, never chosen again)
and nominations. What the preemptor's plan counts on beyond its victims (room already free on its node) is
held from the nomination on, as NOMINATED entries under synthetic UIDs (`hold/<uid>/room-<k>`); when a
victim goes, its entry becomes one too (`hold/<uid>/<victim>`), so that what it freed stays taken until
the preemptor is placed, is deleted or bound elsewhere, or the nomination expires. (kube-scheduler counts
a nominated pod on its node when it filters pods of its priority or lower; docs/preemption.md.)
Holds are released, dropped and restored for one decision only by its Statement
(`gpupool_sched.framework.statement`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence

from gpupool_sched.cache.entries import TERMINATING, Nomination, Phase, PodEntry
from gpupool_sched.cache.gates import Gates
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest

log = logging.getLogger(__name__)


class Nominator(Gates):
    def nominate(self, uid: str, key: str, node: str, priority: int, victims: Iterable[str],
                 timeout_s: float, room: Sequence[tuple[PodRequest, Placement]] = ()) -> Nomination:
        """Mark `victims` as evicted for `uid` (never chosen again) and record where it waits. `room`:
        what its plan takes on `node` beyond what the victims free (`placement.held_room.held_room`),
        held for it from now on, like what its victims free once they go."""
        self.end_nomination(uid)
        self.preemptions[uid] = self.preemptions.get(uid, 0) + 1
        nomination = Nomination(uid, key, node, priority, set(), self.clock() + timeout_s)
        self._nominated_on[uid] = node
        for victim in victims:
            entry = self.pods[victim]
            if entry.evicting_for is not None:
                raise ValueError(f"pod {entry.key} is already being evicted for {entry.evicting_for}")
            entry.evicting_for = uid
            nomination.victims.add(victim)
        self.nominations[uid] = nomination
        for k, (request, placement) in enumerate(room):
            hold = PodEntry(f"hold/{uid}/room-{k}", f"hold for {key} (free room)", node, request, placement,
                            Phase.NOMINATED, True, self.clock())
            self.pods[hold.uid] = hold
            self.by_node[node].add(hold.uid)
            nomination.holds.add(hold.uid)
            self._apply(hold)
            self._tell(hold)
        return nomination

    def mark_moving(self, uid: str, mover: str) -> None:
        """Mark `mover` as evicted for `uid` without a nomination (background consolidation: nothing waits
        for the room it leaves, which is free once it goes); `spare` un-marks it."""
        entry = self.pods[mover]
        if entry.evicting_for is not None:
            raise ValueError(f"pod {entry.key} is already being evicted for {entry.evicting_for}")
        entry.evicting_for = uid

    def adopt_nomination(self, uid: str, key: str, node: str, priority: int,
                         timeout_s: Callable[[set[str]], float], *,
                         reclaims: Callable[[PodEntry], bool] | None = None) -> Nomination | None:
        """A pending pod shows `status.nominatedNodeName: node` that this instance did not decide: another
        leader preempted for it before a failover, or this one before a restart. Hold for it as that
        leader did (kube-scheduler rebuilds its nominator from the same field): the node's pods of lower
        priority that are already terminating become its victims, and those that go later join as they
        go. `timeout_s(victims)`: how long it holds. `reclaims(entry)`: True for a terminating pod a quota
        reclaim for this pod may have evicted, whatever its priority (QuotaBook.reclaimable_by). None when
        there is nothing to adopt (the node is unknown, or this nomination was seen)."""
        if self._nominated_on.get(uid) == node or node not in self.nodes or uid in self.pods:
            return None
        self.end_nomination(uid)
        self._nominated_on[uid] = node
        nomination = Nomination(uid, key, node, priority, set(), 0.0, adopted=True, hold_for=timeout_s,
                                reclaims=reclaims)
        self.nominations[uid] = nomination
        for victim in sorted(self.by_node.get(node, ())):
            entry = self.pods[victim]
            if entry.evicting_for == TERMINATING and (entry.request.priority < priority
                                                      or (reclaims is not None and reclaims(entry))):
                entry.evicting_for = uid
                nomination.victims.add(victim)
        nomination.deadline = self.clock() + timeout_s(nomination.victims)
        log.info("pod %s: adopted its nomination on %s (%d victim(s) terminating)", key, node,
                 len(nomination.victims))
        return nomination

    def drop_adopted(self, uid: str) -> bool:
        """The pod's nominatedNodeName was cleared by whoever set it: an adopted nomination ends."""
        nomination = self.nominations.get(uid)
        if nomination is None or not nomination.adopted:
            return False
        self._nominated_on.pop(uid, None)
        return self.end_nomination(uid)

    def _join_adopted(self, entry: PodEntry) -> None:
        """A pod started terminating (or went) on a node where an adopted nomination of higher priority
        waits: what it frees is held for that nomination's pod, the highest priority first."""
        best: Nomination | None = None
        for nomination in self.nominations.values():
            if (nomination.adopted and nomination.node == entry.node
                    and (nomination.priority > entry.request.priority
                         or (nomination.reclaims is not None and nomination.reclaims(entry)))
                    and (best is None or nomination.priority > best.priority)):
                best = nomination
        if best is not None:
            entry.evicting_for = best.uid
            best.victims.add(entry.uid)
            if best.hold_for is not None:  # it holds as long as this victim's grace needs too
                best.deadline = max(best.deadline, self.clock() + best.hold_for({entry.uid}))

    def nomination_live(self, uid: str) -> bool:
        """kube-scheduler's PodEligibleToPreemptOthers, inverted: the pod's victims are still terminating."""
        nomination = self.nominations.get(uid)
        return nomination is not None and nomination.deadline > self.clock() and bool(nomination.victims)

    def spare(self, uid: str, victims: Iterable[str]) -> None:
        """`victims` will not be evicted for `uid` after all (an eviction failed): they run on."""
        nomination = self.nominations.get(uid)
        for victim in victims:
            entry = self.pods.get(victim)
            if entry is not None and entry.evicting_for == uid:
                entry.evicting_for = None
            if nomination is not None:
                nomination.victims.discard(victim)

    def end_nomination(self, uid: str) -> bool:
        """Drop `uid`'s nomination and release its holds (True when that freed resources). Victims
        still terminating stay marked: their evictions are out (`spare` un-marks unsent ones)."""
        nomination = self.nominations.pop(uid, None)
        if nomination is None:
            return False
        freed = False
        for hold in nomination.holds:
            entry = self._unlink(hold)
            if entry is not None:
                freed |= entry.applied
                self._unapply(entry)
        return freed

    def release_holds(self, uid: str) -> list[PodEntry]:
        """Un-account `uid`'s holds for its own decision; `assume` then drops them, `restore_holds`
        takes them back when it still fits nowhere."""
        nomination = self.nominations.get(uid)
        if nomination is None:
            return []
        released = [self.pods[h] for h in sorted(nomination.holds) if h in self.pods]
        for entry in released:
            self._unapply(entry)
        return released

    def release_lower_holds(self, priority: int, own: Collection[str]) -> list[str]:
        """Un-account the holds of every nomination of lower priority than `priority` (but `own`'s),
        for one decision: kube-scheduler counts a nominated pod against pods of its priority or lower only,
        so a more important pod may take the room. Returns the nominations released."""
        released = []
        for nomination in self.nominations.values():
            if nomination.priority < priority and nomination.uid not in own and nomination.holds:
                self.release_holds(nomination.uid)
                released.append(nomination.uid)
        return released

    def drop_holds(self, uid: str) -> None:
        """`uid`'s released holds are gone for good (a more important pod took that room): the nomination
        stays (its victims may still be terminating), holding nothing; its pod may preempt again later."""
        nomination = self.nominations.get(uid)
        if nomination is None:
            return
        for hold in list(nomination.holds):
            self._unlink(hold)  # un-accounted already (`release_holds`)
        nomination.holds.clear()

    def unheld(self, own: Collection[str], priority: int | None = None) -> list[PodEntry]:
        """The accounted holds a decision for `own` does not count: those of `own`'s nominations and (with
        `priority`) of every nomination of lower priority, as `Statement.release_holds` releases them."""
        out = []
        for nomination in self.nominations.values():
            if nomination.uid in own or (priority is not None and nomination.priority < priority):
                out += [e for h in sorted(nomination.holds) if (e := self.pods.get(h)) is not None and e.applied]
        return out

    def unheld_snapshot(self, own: Collection[str], priority: int | None = None) -> ClusterSnapshot:
        """A copy of the snapshot without the holds `unheld` names: what a decision for `own` may count on."""
        snapshot = self.snapshot.copy()
        for entry in self.unheld(own, priority):
            snapshot.release(entry.request, entry.placement)
        return snapshot

    def restore_holds(self, uid: str) -> None:
        nomination = self.nominations.get(uid)
        for hold in sorted(nomination.holds) if nomination else ():
            entry = self.pods.get(hold)
            if entry is not None:
                self._apply(entry)

    def expire_nominations(self) -> list[Nomination]:
        """Nominations past their deadline, ended (their holds released)."""
        now = self.clock()
        stale = [n for n in self.nominations.values() if n.deadline <= now]
        for nomination in stale:
            log.info("pod %s: nomination on %s expired", nomination.key, nomination.node)
            self.end_nomination(nomination.uid)
        return stale

    def _to_hold(self, entry: PodEntry) -> bool:
        """A victim went: keep what it held for its preemptor, under a synthetic UID."""
        nomination = self.nominations.get(entry.evicting_for or "")
        if nomination is None or entry.phase is Phase.NOMINATED:
            return False
        victim = entry.uid
        self._unlink(victim)
        nomination.victims.discard(victim)
        entry.uid = f"hold/{nomination.uid}/{victim}"
        entry.key = f"hold for {nomination.key} (was {entry.key})"
        entry.phase, entry.since, entry.ours = Phase.NOMINATED, self.clock(), True
        self.pods[entry.uid] = entry
        self.by_node[entry.node].add(entry.uid)
        nomination.holds.add(entry.uid)
        self._tell(entry)
        return True
