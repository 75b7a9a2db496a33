"""Make-before-break migration (docs/defragmentation.md, "Make-before-break"): a mover whose ReplicaSet
belongs to a Deployment annotated `gpupool.io/migrate: surge` is not evicted. Its Deployment is scaled up by
one; the ReplicaSet's new replica is placed on the destination held for the mover (the reservation: same
controller, same request); once the new replica is Ready, the mover gets the lowest
`controller.kubernetes.io/pod-deletion-cost` and the Deployment is scaled back down, so that its ReplicaSet
removes the mover. The Deployment never has fewer Ready replicas than its spec had before.

What may go wrong, and what is left behind (never an extra replica, never a count someone else set):

  * the new replica is not Ready within `timeout_s`, or the pod the migration makes room for goes away (or
    is placed elsewhere, or its nomination ends): roll back. The new replica gets the lowest deletion cost
    and the count goes back down, so the ReplicaSet removes the new replica, not the mover;
  * the count is changed by someone else during the surge (a person, a GitOps tool): the scheduler does
    not write it again (it is theirs now), and the migration stops;
  * every write of the count is a read-modify-write with the Deployment's resourceVersion as precondition:
    a conflict (409) is read again and decided again; the Deployment gone (404) ends the surge;
  * an HPA scales the Deployment, or a rollout is under way: no surge (and no eviction either: the
    annotation promises no capacity dip). The HPA owns spec.replicas: a surge at its maxReplicas is undone
    by it at once, and its scale-down stabilisation window remembers the surged count.

A surge outlives its leader: before the scale-up the mover's ReplicaSet gets the `gpupool.io/surge`
annotation (the count before, the mover, the pod it makes room for, the deadline for Ready; `SurgeRecord`)
and the label `gpupool.io/surging`, removed once the count is back (or is someone else's). (Not on the
Deployment: any change of a Deployment's annotations bumps its generation, which reads as a rollout.) A
leader (a new one after a failover, or this one after a restart) finds the ReplicaSets so labelled with one
LIST
(`recover_all`, when it starts leading and then now and then) and finishes each surge (the new replica
Ready, the pod it makes room for still nominated: the mover's deletion cost, the count back) or rolls it
back (the deadline passed, the mover or the pod it made room for gone), never writing a count that is not
the surge's any more.

The new replica's readiness is read from the ledger (the pod watch the scheduler has anyway), not polled
from the API server.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gpupool_sched.cache.entries import Phase, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.kube.kubeapi import ApiError, KubeApi, deployment_path
from gpupool_sched.writer.surge_record import (
    CONFLICT_RETRIES,
    DEFAULT_SURGE_TIMEOUT_S,
    LOWEST_COST,
    REPLICA_SETS,
    SCALE_DOWN_WINDOW_S,
    SURGE_RECORD,
    SURGING,
    Deployment,
    Mover,
    Outcome,
    SurgeRecord,
)
from gpupool_sched.writer.surge_target import may_surge, surging_deployment

log = logging.getLogger(__name__)


class Surger:
    def __init__(self, state: ClusterState, api: KubeApi, *, timeout_s: float = DEFAULT_SURGE_TIMEOUT_S,
                 poll_s: float = 0.2) -> None:
        self.state = state
        self.api = api
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        # the holds of the blocked pod's migration were extended: its record (on the pod) says so too
        self.on_extended: Callable[[str], Awaitable[None]] | None = None

    # ---- the surge -----------------------------------------------------------------------------------
    async def deployment_of(self, entry: PodEntry) -> Deployment | None:
        """The mover's Deployment when it surges, else None (`surge_target.surging_deployment`)."""
        return await surging_deployment(self.api, entry)

    async def may_surge(self, target: Deployment) -> Outcome | int:
        return await may_surge(self.api, target)

    async def move(self, blocked: str, mover: PodEntry, target: Deployment, replicas: int,
                   destination: str, live: Callable[[], bool] | None = None) -> Outcome:
        """Move `mover` by surge for the blocked pod `blocked` (nominated, the destination reserved), its
        Deployment at `replicas` (`may_surge`). `live()`: the migration still stands (default: `blocked`
        is still nominated; a background migration, which nominates nobody, says its own)."""
        # what the ledger entry says now: once the mover goes, its entry becomes the blocked pod's hold
        who = Mover(mover.uid, mover.key, mover.owner, self.state.replaced.get(mover.uid, mover.uid),
                     mover.pod_grace_s)
        before = {uid for uid, e in self.state.pods.items() if e.owner == who.owner}
        now = time.time()
        record = SurgeRecord(replicas, who.uid, who.key, who.owner, blocked, now, now + self.timeout_s)
        # under way here before the record exists: this process's own look for unfinished surges skips it
        self.state.surging[who.uid] = (mover.node, destination)
        try:
            try:  # first the record, where the next leader finds it: a surge never outlives its undo
                await self.api.mark_replica_set(target.namespace, target.replica_set,
                                                {SURGE_RECORD: record.encode()}, {SURGING: "true"})
            except ApiError as exc:
                if exc.status == 404:
                    return Outcome("refused", f"Deployment {target.key} is gone")
                return Outcome("failed", f"recording the surge on ReplicaSet {target.namespace}/"
                               f"{target.replica_set} failed: {exc}",
                               replicas=replicas)
            outcome = await self._surge(blocked, who, target, replicas, before,
                                        live or (lambda: blocked in self.state.nominations))
            await self._settle(target, record)  # not when cancelled: as for a leader that died, the next settles
            return outcome
        finally:
            self.state.surging.pop(who.uid, None)

    async def _settle(self, target: Deployment, record: SurgeRecord) -> bool:
        """The surge is over: its record goes, unless the count is still the surge's (a scale-down that
        failed: the next look, `recover_all`, tries it again). True when it went (or nothing is left)."""
        try:
            deployment = await self.api.read_object(deployment_path(target.namespace, target.name))
            if (deployment.get("spec") or {}).get("replicas", 1) == record.replicas + 1:
                log.warning("surge of Deployment %s: still at %d; left for the next look", target.key,
                            record.replicas + 1)
                return False
            await self.api.mark_replica_set(target.namespace, target.replica_set, {SURGE_RECORD: None},
                                            {SURGING: None})
        except ApiError as exc:
            if exc.status == 404:
                return True
            log.warning("surge of Deployment %s: removing its record failed (%s)", target.key, exc)
            return False
        return True

    # ---- a surge another leader (or this process before a restart) left unfinished --------------------
    async def recover_all(self) -> list[tuple[SurgeRecord, Outcome]]:
        """Find the ReplicaSets marked mid-surge (one LIST by label) and finish or undo each surge not under
        way here. Returns how each ended ("waiting": its new replica may still become Ready)."""
        items, _ = await self.api.call(self.api.list_raw_sync, REPLICA_SETS, params=(("labelSelector", SURGING),))
        out = []
        for rs in items:
            meta = rs.get("metadata") or {}
            namespace, rs_name = str(meta.get("namespace", "")), str(meta.get("name", ""))
            raw = (meta.get("annotations") or {}).get(SURGE_RECORD)
            if not isinstance(raw, str) or not raw:
                continue
            try:
                record = SurgeRecord.decode(raw)
            except ValueError as exc:
                log.warning("ReplicaSet %s/%s: %s", namespace, rs_name, exc)
                continue
            if record.mover in self.state.surging:
                continue  # this process's own surge, under way
            ref = next((r for r in meta.get("ownerReferences") or ()
                        if isinstance(r, Mapping) and r.get("controller") is True and r.get("kind") == "Deployment"),
                       None)
            name = str(ref.get("name", "")) if ref is not None else ""
            target = Deployment(namespace, name, str(ref.get("uid", "")) if ref else "", rs_name, f"{namespace}/{name}")
            try:
                deployment = (await self.api.read_object(deployment_path(namespace, name)) if name
                              else {"spec": {"replicas": -1}})  # no Deployment: nothing to scale back
                out.append((record, await self.recover(target, deployment, record)))
            except ApiError as exc:
                if exc.status == 404:  # the Deployment is gone: nothing to scale back
                    out.append((record, await self.recover(target, {"spec": {"replicas": -1}}, record)))
                    continue
                log.warning("surge of Deployment %s: recovering it failed (%s); trying again later", target.key, exc)
        return out

    async def recover(self, target: Deployment, deployment: Mapping[str, Any], record: SurgeRecord) -> Outcome:
        """Finish or undo one surge found on its Deployment (`record`), as it reads now."""
        replicas = (deployment.get("spec") or {}).get("replicas", 1)
        if replicas != record.replicas + 1:  # back already, or someone else's count now: nothing to undo
            await self._settle(target, record)
            return Outcome("left", f"spec.replicas of Deployment {target.key} is {replicas}, not the surge's "
                           f"{record.replicas + 1}", replicas=record.replicas)
        mover = self.state.pods.get(record.mover)
        new = self._replica_since(record)
        seen = Mover(new.uid, new.key, new.owner, "", None, new.node) if new is not None else None
        if mover is None:  # gone: its room is free; the count goes back (the ReplicaSet removes its least ready)
            outcome = await self._roll_back(target, record.replicas, None, "gone",
                                            f"{record.pod} went away during the surge")
        elif record.blocked not in self.state.nominations:
            outcome = await self._roll_back(target, record.replicas, seen, "abandoned", "the pod it made room for "
                                            "went away, was placed elsewhere, or stopped waiting")
        elif new is not None and new.ready:
            outcome = await self._finish(target, record, mover, seen)
        elif time.time() < record.until:
            return Outcome("waiting", None, seen.key if seen else None, seen.node if seen else None, record.replicas)
        else:
            said = f"the new replica {seen.key}" if seen is not None else "no new replica"
            outcome = await self._roll_back(target, record.replicas, seen, "rolled_back",
                                            f"{said} was not Ready within {record.until - record.at:.0f}s")
        await self._settle(target, record)
        log.info("surge of Deployment %s left by another leader: %s (%s)", target.key, outcome.result,
                 outcome.why or "finished")
        return outcome

    async def _finish(self, target: Deployment, record: SurgeRecord, mover: PodEntry, seen: Mover | None) -> Outcome:
        """The new replica is Ready: the mover goes first, the count goes back."""
        assert seen is not None
        self.state.extend_migration(record.blocked, mover.uid, (mover.pod_grace_s or 30) + SCALE_DOWN_WINDOW_S)
        namespace, _, name = mover.key.partition("/")
        try:
            await self.api.set_deletion_cost(namespace, name, mover.uid, LOWEST_COST)
        except ApiError as exc:
            if exc.status != 404:
                return await self._roll_back(target, record.replicas, seen, "rolled_back",
                                             f"marking {mover.key} to go first failed: {exc}")
        scaled = await self._scale(target, record.replicas + 1, record.replicas, SCALE_DOWN_WINDOW_S)
        if scaled is not None:
            return Outcome("failed", scaled, seen.key, seen.node, record.replicas)
        return Outcome("surged", None, seen.key, seen.node, record.replicas)

    def _replica_since(self, record: SurgeRecord) -> PodEntry | None:
        """The surge's new replica as far as the ledger tells (the set of pods before it is not known here):
        a placed pod of the mover's controller that started since the surge began, the Ready one first,
        then the newest."""
        found = [e for uid, e in self.state.pods.items()
                 if e.owner == record.owner and uid != record.mover and e.started >= math.floor(record.at)
                 and e.phase in (Phase.ASSUMED, Phase.BOUND, Phase.CONFIRMED)]
        if not found:
            return None
        return min(found, key=lambda e: (not e.ready, -e.started))

    async def _surge(self, blocked: str, mover: Mover, target: Deployment, replicas: int,
                     before: set[str], live: Callable[[], bool]) -> Outcome:
        await self._extend(blocked, mover.uid, self.timeout_s + SCALE_DOWN_WINDOW_S)
        try:
            scaled = await self._scale(target, replicas, replicas + 1)
        except ApiError as exc:
            why = f"scaling Deployment {target.key} to {replicas + 1} failed: {exc}"
            if exc.status == 0 or exc.status >= 500:  # it may have been done: undo it if so
                return await self._roll_back(target, replicas, None, "failed", why)
            return Outcome("failed", why, replicas=replicas)
        if scaled is not None:
            return Outcome("failed", scaled, replicas=replicas)
        log.info("surge: Deployment %s scaled %d -> %d to move %s", target.key, replicas, replicas + 1, mover.key)
        deadline = self.state.clock() + self.timeout_s
        seen: Mover | None = None  # the new replica, as last seen in the ledger
        while True:
            new = self._new_replica(mover, before)
            if new is not None:
                seen = Mover(new.uid, new.key, new.owner, "", None, new.node)
                if new.ready:
                    break
            if mover.uid not in self.state.pods:  # deleted by someone else: its room is free already
                return await self._roll_back(target, replicas, None, "gone", f"{mover.key} went away during the surge")
            if not live():
                why = "the pod it made room for went away, was placed elsewhere, or stopped waiting"
                return await self._roll_back(target, replicas, seen, "abandoned", why)
            if self.state.clock() >= deadline:
                said = f"the new replica {seen.key}" if seen is not None else "no new replica"
                why = f"{said} was not Ready within {self.timeout_s:.0f}s"
                return await self._roll_back(target, replicas, seen, "rolled_back", why)
            await asyncio.sleep(self.poll_s)
        assert seen is not None
        # the new replica is Ready: the mover goes, the count goes back
        await self._extend(blocked, mover.uid, (mover.grace_s or 30) + SCALE_DOWN_WINDOW_S)
        namespace, _, name = mover.key.partition("/")
        try:
            await self.api.set_deletion_cost(namespace, name, mover.uid, LOWEST_COST)
        except ApiError as exc:
            if exc.status != 404:  # gone already: the scale-down removes whichever ranks lowest
                return await self._roll_back(target, replicas, seen, "rolled_back",
                                             f"marking {mover.key} to go first failed: {exc}")
        try:
            scaled = await self._scale(target, replicas + 1, replicas, SCALE_DOWN_WINDOW_S)
        except ApiError as exc:
            return Outcome("failed", f"scaling Deployment {target.key} back to {replicas} failed: {exc}", seen.key,
                           seen.node, replicas)
        if scaled is not None:
            return Outcome("failed", scaled, seen.key, seen.node, replicas)
        log.info("surge: %s Ready on %s; Deployment %s back to %d, %s goes", seen.key, seen.node, target.key,
                 replicas, mover.key)
        return Outcome("surged", None, seen.key, seen.node, replicas)

    async def _extend(self, blocked: str, mover: str, seconds: float) -> None:
        """The holds last `seconds` more, here and in the blocked pod's migration record (where a standby
        and the next leader read them)."""
        self.state.extend_migration(blocked, mover, seconds)
        if self.on_extended is not None:
            await self.on_extended(blocked)

    def _new_replica(self, mover: Mover, before: set[str]) -> PodEntry | None:
        """The ReplicaSet's pod created by the surge: placed since it began, with the mover's controller;
        the one that claimed the mover's reservation first."""
        found = [e for uid, e in self.state.pods.items()
                 if e.owner == mover.owner and uid not in before
                 and e.phase in (Phase.ASSUMED, Phase.BOUND, Phase.CONFIRMED)]
        if not found:
            return None
        return min(found, key=lambda e: (self.state.replaced.get(e.uid) != mover.lineage, not e.ready, e.since))

    async def _roll_back(self, target: Deployment, replicas: int, new: Mover | None, result: str,
                         why: str) -> Outcome:
        """Undo the +1: the new replica (when it is known) goes first, the count goes back if it is still
        ours. Without a known new replica the ReplicaSet removes an unplaced or unready pod first anyway."""
        log.warning("surge of Deployment %s rolled back: %s", target.key, why)
        if new is not None:
            namespace, _, name = new.key.partition("/")
            try:
                await self.api.set_deletion_cost(namespace, name, new.uid, LOWEST_COST)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("marking %s to go first failed: %s", new.key, exc)
        try:
            scaled = await self._scale(target, replicas + 1, replicas, SCALE_DOWN_WINDOW_S)
        except ApiError as exc:
            why += f"; scaling Deployment {target.key} back to {replicas} failed: {exc}"
            return Outcome("failed", why, replicas=replicas)
        if scaled is not None:
            why += f"; {scaled}"
        return Outcome(result, why, new.key if new else None, new.node if new else None, replicas)

    async def _scale(self, target: Deployment, expected: int, replicas: int, persist_s: float = 0.0) -> str | None:
        """spec.replicas `expected` -> `replicas`, read-modify-write under the Deployment's resourceVersion.
        None when done (or, scaling down, the Deployment is gone: nothing left to undo); else why it was left
        alone (someone else changed the count: theirs now). A conflict (409) is read again and decided
        again; an answer lost or a server error is tried again for `persist_s` (a scale-down: no extra
        replica may be left behind). ApiError when it still fails."""
        until = self.state.clock() + persist_s
        conflicts = 0
        while True:
            try:
                deployment = await self.api.read_object(deployment_path(target.namespace, target.name))
                now = (deployment.get("spec") or {}).get("replicas", 1)
                if now != expected:
                    return (f"spec.replicas of Deployment {target.key} is {now}, not {expected}: changed by "
                            "someone else, left as it is")
                version = str((deployment.get("metadata") or {}).get("resourceVersion", ""))
                await self.api.scale_deployment(target.namespace, target.name, replicas, version)
                return None
            except ApiError as exc:
                if exc.status == 404:
                    return None if replicas < expected else f"Deployment {target.key} is gone"
                if exc.status == 409 and conflicts < CONFLICT_RETRIES:
                    conflicts += 1
                    log.info("scaling Deployment %s: conflict (%s); reading it again", target.key, exc.message)
                    continue
                if not (exc.status in (0, 429) or exc.status >= 500) or self.state.clock() >= until:
                    raise
                log.warning("scaling Deployment %s to %d failed (%s); trying again", target.key, replicas, exc)
                await asyncio.sleep(min(1.0, self.poll_s * 5))
