"""Who may be moved to defragment, and when (the consolidate action's plugin; docs/defragmentation.md).

A pod is movable when something recreates it or it says it may go: owned by a ReplicaSet (a Deployment's)
or a StatefulSet; owned by a batch/v1 Job whose podFailurePolicy ignores the disruption (`tolerates_disruption`:
the Job does not fail or count the evicted pod, and makes a new one); or annotated `gpupool.io/movable: "true"`.
Never: `gpupool.io/movable: "false"` (the annotation wins either way), a bare pod without the annotation, a
Job's pod whose Job does not tolerate a disruption (or is not known: the Jobs are watched only while the
action is on), a pod younger than `min_runtime_s`, a gang member (a gang moves whole or not at all; not
planned yet), a pod a PodDisruptionBudget protects now, a pod being evicted, a pod (or a replacement of it)
moved within `cooldown_s`, and a pod of a controller whose surge was refused or rolled back within
`cooldown_s` (writer/surge.py: an HPA scales its Deployment, its new replica was not Ready in time), and a
pod another scheduler places (its replacement would never take the room held for it). Only pods that hold
GPUs are candidates: moving a CPU-only pod frees no GPU.

The movable pods are kept in a set by a ledger watcher (`Movers._track`), with the Job-owned ones indexed
by their Job, so that a Job that appears or goes re-judges its own pods only.

Budgets that stop storms: a pod waits `after_s` before anything moves for it; at most `per_hour` moves
in the last hour cluster-wide (default 1 % of the running GPU pods, at least 1); at most one migration
at a time per node (`ClusterState.migrating_nodes`, asked by the action).

The moves of the last hour and the cooldowns outlive the leader: every move is read back from the pods
(`remember`, from the blocked pod's `gpupool.io/migration` record and the replacement's
`gpupool.io/moved` annotation, wall-clock times), so a restarted scheduler or a new leader counts the same
moves and keeps the same pods in place (docs/defragmentation.md, "The budgets survive a failover")."""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sched.cache.entries import Phase, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL
from gpupool_sched.framework.plugins.victims import DisruptionBudgets
from gpupool_sched.kube.informer import WatchedKind
from gpupool_sched.kube.kubeapi import ApiError
from gpupool_sched.placement.consolidation import Movable
from gpupool_sched.placement.preemption import RunningPod

log = logging.getLogger(__name__)

RECREATING_KINDS = ("ReplicaSet", "StatefulSet")
BUDGET_REFRESH_S = 30.0  # the default budget (1 % of running GPU pods) is recounted this often, not every tick
JOBS = "/apis/batch/v1/jobs"
DISRUPTION_TARGET = "DisruptionTarget"  # the pod condition an eviction (the Eviction API) adds


@dataclass(frozen=True, slots=True)
class Offer:
    """What the consolidate action may move for a lone pod now (`Movers.offer`): the candidates (None:
    nothing moves for it), at most how many, why nothing moves (None: no reason to tell), and whether it
    may only look (`later`: it has not waited `after_s`; a move found then holds preemption back)."""

    candidates: Callable[[], list[Movable]] | None = None
    most: int | None = None
    why_not: str | None = None
    later: bool = False


def tolerates_disruption(job: Mapping[str, Any]) -> bool:
    """Whether a Job takes the eviction of one of its pods in its stride: its `spec.podFailurePolicy` has an
    `action: Ignore` rule whose `onPodConditions` holds `{type: DisruptionTarget}` with status True (the
    default; "False" or "Unknown" does not match an evicted pod), and every rule before it is an Ignore rule
    too. The Job controller takes the FIRST rule that matches a failed pod; an evicted pod has the
    DisruptionTarget condition, but its containers also exit with whatever code the workload gives on
    SIGTERM (143 by default, 137 when killed after the grace period, anything when it handles the signal),
    so a FailJob, FailIndex or Count rule on exit codes before it (`NotIn [0]`, or `In [42]` as in the
    Kubernetes documentation's example) may match first and fail the Job or count the pod against its
    backoffLimit; so may a rule on other pod conditions (Ready False). Such a Job's pods do not move: put
    the Ignore rule first. Anything malformed counts as not tolerating."""
    spec = job.get("spec")
    policy = spec.get("podFailurePolicy") if isinstance(spec, Mapping) else None
    rules = policy.get("rules") if isinstance(policy, Mapping) else None
    if not isinstance(rules, list):
        return False
    for rule in rules:
        if not isinstance(rule, Mapping) or rule.get("action") != "Ignore":
            return False  # a rule that is not Ignore could match the evicted pod first
        if _on_disruption(rule):
            return True
    return False


def _on_disruption(rule: Mapping[str, Any]) -> bool:
    """The rule's pod conditions match an evicted pod's DisruptionTarget=True."""
    patterns = rule.get("onPodConditions")
    if not isinstance(patterns, list) or rule.get("onExitCodes") is not None:
        return False
    return any(isinstance(p, Mapping) and p.get("type") == DISRUPTION_TARGET and p.get("status") in (None, "", "True")
               for p in patterns)


def movable_kind(entry: PodEntry, tolerant_jobs: Collection[str] = ()) -> bool:
    """The pod says it may move, or its controller recreates it (and it does not say no): a ReplicaSet, a
    StatefulSet, or a Job in `tolerant_jobs` (UIDs of the Jobs that `tolerates_disruption`)."""
    if entry.movable is not None:
        return entry.movable
    if entry.job:
        return entry.job in tolerant_jobs
    return entry.owner.partition("/")[0] in RECREATING_KINDS


@dataclass
class Movers:
    state: ClusterState
    budgets: DisruptionBudgets
    config: DefragConfig = field(default_factory=DefragConfig)
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time  # pods' start times are wall-clock seconds
    moves: deque[float] = field(default_factory=deque)  # clock of every move in the last hour
    moved: dict[str, float] = field(default_factory=dict)  # lineage (first UID) -> clock of its last move
    movable: set[str] = field(default_factory=set)  # ledger entries of a movable kind (kept by a watcher)
    tolerant_jobs: set[str] = field(default_factory=set)  # UIDs of the Jobs that tolerate a disruption (the watch)
    job_pods: dict[str, set[str]] = field(default_factory=dict)  # Job UID -> its pods in the ledger
    pod_job: dict[str, str] = field(default_factory=dict)  # ledger UID -> the Job it is indexed under
    gpu_pods: int = 0  # running pods holding GPUs, as of the last `refresh` (the default budget's base)
    refused: dict[str, float] = field(default_factory=dict)  # controller -> clock: its surge was refused then
    counted: dict[str, float] = field(default_factory=dict)  # mover UID -> clock of its move (counted once)
    cooling_until: float | None = None  # the last `candidates`: when the first pod left out by a cooldown may move

    def __post_init__(self) -> None:
        for entry in list(self.state.pods.values()):
            self._track(entry)
        self.state.watchers.append(self._track)
        self.refresh()

    def refresh(self) -> None:
        """Count the running GPU pods (housekeeping, every `BUDGET_REFRESH_S`: not on every decision)."""
        self.gpu_pods = sum(1 for e in self.state.running() if _holds_gpus(e))

    def _track(self, entry: PodEntry) -> None:
        """A ledger entry joined, left or changed: candidates are looked for among the movable ones only
        (a cluster of bare pods costs nothing however many pods wait)."""
        present = entry.uid in self.state.pods
        self._index(entry.uid, entry.job if present else "")
        if present and movable_kind(entry, self.tolerant_jobs):
            self.movable.add(entry.uid)
        else:
            self.movable.discard(entry.uid)

    def _index(self, uid: str, job: str) -> None:
        """File the ledger entry `uid` under its Job (`job`; "": none, or it left the ledger)."""
        before = self.pod_job.get(uid, "")
        if before == job:
            return
        if before:
            pods = self.job_pods[before]
            pods.discard(uid)
            if not pods:
                del self.job_pods[before]
            del self.pod_job[uid]
        if job:
            self.job_pods.setdefault(job, set()).add(uid)
            self.pod_job[uid] = job

    def on_job(self, kind: str | None, obj: Mapping[str, Any]) -> None:
        """A Job's watch event: when whether it tolerates a disruption changed (it appeared or went; its
        podFailurePolicy cannot change), its pods in the ledger are judged again."""
        uid = (obj.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        tolerant = kind != "DELETED" and tolerates_disruption(obj)
        if tolerant == (uid in self.tolerant_jobs):
            return
        if tolerant:
            self.tolerant_jobs.add(uid)
        else:
            self.tolerant_jobs.discard(uid)
        for pod in list(self.job_pods.get(uid, ())):
            entry = self.state.pods.get(pod)
            if entry is not None:
                self._track(entry)

    def any_movable(self, priority: int) -> bool:
        """Cheap: some pod of a movable kind and no higher priority than `priority` holds a GPU now."""
        pods = self.state.pods
        return any((e := pods.get(uid)) is not None and e.phase in (Phase.BOUND, Phase.CONFIRMED)
                   and e.request.priority <= priority and _holds_gpus(e) for uid in self.movable)

    def budget(self) -> int:
        """Moves allowed per hour now."""
        if self.config.per_hour is not None:
            return self.config.per_hour
        return max(1, math.floor(self.gpu_pods / 100))

    def budget_left(self) -> int:
        now = self.clock()
        while self.moves and self.moves[0] <= now - 3600.0:
            self.moves.popleft()
        return max(0, self.budget() - len(self.moves))

    def may_move_for(self, waited_s: float) -> str | None:
        """None when moving pods for a pod that waited `waited_s` is allowed now, else why not (for the
        pod's Event when nothing else helps either)."""
        if not self.config.enabled:
            return "defragmentation is off"
        if waited_s < self.config.after_s:
            return f"pods move for a pod only after it waited {self.config.after_s:.0f}s"
        if self.budget_left() <= 0:
            return f"the defragmentation budget ({self.budget()} moves per hour) is spent"
        return None

    def offer(self, waited_s: float, priority: int) -> Offer:
        """What may move for a lone pod of `priority` that may preempt and has waited `waited_s`. Before
        `after_s` the action only looks (and only when the budget has moves left and some pod could
        move); after it, the budget and the cooldowns decide (`may_move_for`, `candidates`)."""
        if not self.config.enabled:
            return Offer()
        most = min(self.config.max_movers, self.budget_left())
        if waited_s < self.config.after_s:
            if most <= 0 or not self.any_movable(priority):
                return Offer()
            return Offer(lambda: self.candidates(priority), most, None, True)
        self.cooling_until = None  # what `candidates` leaves out for this pod, if it is asked
        why = self.may_move_for(waited_s)
        if why is not None:
            return Offer(why_not=why)
        return Offer(lambda: self.candidates(priority), most)

    def wait_over_at(self, first_seen: float, priority: int) -> float | None:
        """A lone pod that fits nowhere has not waited `after_s` yet (first seen at `first_seen`, the clock):
        when to try it again, None when nothing could move for it at all."""
        if self.config.enabled and self.any_movable(priority):
            return first_seen + self.config.after_s
        return None

    def held_until(self) -> float | None:
        """Nothing moved for a pod though pods may move for it: when pods the last `candidates` left out by
        their cooldown may move again, or the spent budget allows a move again (the clock); None: neither."""
        times = [t for t in (self.cooling_until, self.budget_frees_at()) if t is not None]
        return min(times) if times else None

    def candidates(self, priority: int) -> list[Movable]:
        """Running pods that may move for a pod of `priority` (none of higher priority), at most as many
        as the budget has left."""
        now_wall, now = self.wall(), self.clock()
        out: list[Movable] = []
        self.cooling_until = None
        for uid in sorted(self.movable):
            entry = self.state.pods.get(uid)
            if (entry is None or not entry.ours or entry.phase not in (Phase.BOUND, Phase.CONFIRMED)
                    or entry.evicting_for is not None
                    or not entry.applied or entry.request.priority > priority or not _holds_gpus(entry)
                    or not movable_kind(entry, self.tolerant_jobs)
                    or POD_GROUP_LABEL in entry.labels or entry.started <= 0
                    or now_wall - entry.started < self.config.min_runtime_s):
                continue
            namespace = entry.key.partition("/")[0]
            covering = self.budgets.covering(namespace, entry.labels) if self.budgets.budgets else ()
            if any(allowed <= 0 for _, allowed in covering):
                continue
            cooled = self._cooled(entry, now)
            if cooled is not None:  # moved (or its surge refused) within the cooldown: tried again after it
                self.cooling_until = cooled if self.cooling_until is None else min(self.cooling_until, cooled)
                continue
            out.append(Movable(RunningPod(entry.uid, entry.node, entry.request.priority, entry.request,
                                          entry.placement, entry.started, False, covering), entry.owner))
        return out

    def _cooled(self, entry: PodEntry, now: float) -> float | None:
        """When `entry` may move again (the clock), None when it may now: moved itself, or the pod it
        replaces, or (a StatefulSet's) a pod of its name, within the cooldown; or its controller's surge
        refused within it."""
        last = self.moved.get(self.state.replaced.get(entry.uid, entry.uid))
        if entry.owner.startswith("StatefulSet/"):
            by_name = self.moved.get(_by_name(entry.key))
            if by_name is not None and (last is None or by_name > last):
                last = by_name
        refused = self.refused.get(entry.owner) if self.refused else None
        if refused is not None and (last is None or refused > last):
            last = refused
        if last is None or now - last >= self.config.cooldown_s:
            return None
        return last + self.config.cooldown_s

    def budget_frees_at(self) -> float | None:
        """When the budget allows a move again (the clock), None when it does now (or never: a budget of 0)."""
        if self.budget_left() > 0 or not self.moves or self.budget() <= 0:
            return None
        return self.moves[len(self.moves) - self.budget()] + 3600.0

    def refuse(self, owner: str, refunded: str | None = None) -> None:
        """A surge of `owner`'s Deployment was refused before anything was written (an HPA scales it, a
        rollout was under way), or rolled back (its new replica not Ready in time): none of its pods is
        planned as a mover within the cooldown. `refunded`: the mover whose move does not count on the
        budget (refused: nothing was disturbed); its own move, not the newest."""
        now = self.clock()
        self.refused[owner] = now
        at = self.counted.get(refunded) if refunded is not None else None  # stays counted: never read back in
        if at is not None and at in self.moves:
            self.moves.remove(at)
        for key in [k for k, at in self.refused.items() if now - at >= self.config.cooldown_s]:
            del self.refused[key]

    def carried_out(self, movers: Iterable[str]) -> None:
        """These pods are being moved: they count on the budget and start their cooldown."""
        now = self.clock()
        for uid in movers:
            self.moves.append(now)
            self.counted[uid] = now
            self.moved[self.state.replaced.get(uid, uid)] = now
            entry = self.state.pods.get(uid)
            if entry is not None and entry.owner.startswith("StatefulSet/"):
                self.moved[_by_name(entry.key)] = now
        self._prune(now)

    def remember(self, mover: str, lineage: str, key: str, owner: str, at: float) -> None:
        """A move read back from the API (a migration record, a replacement's `gpupool.io/moved`): `mover`
        (its UID, counted once on the budget however often it is read), of the line `lineage`, the pod
        `key` of the controller `owner`, moved at `at` (wall-clock seconds): it counts on the budget for
        an hour and keeps its line (and a StatefulSet's pod name) in place for the cooldown, here as on
        the leader that moved it."""
        now = self.clock()
        when = now - max(0.0, self.wall() - at)
        if now - when >= max(self.config.cooldown_s, 3600.0):
            return
        if mover not in self.counted:
            self.counted[mover] = when
            if now - when < 3600.0:
                bisect.insort(self.moves, when)
        keys = [lineage, _by_name(key)] if owner.startswith("StatefulSet/") else [lineage]
        for k in keys:
            if self.moved.get(k, float("-inf")) < when:
                self.moved[k] = when

    def _prune(self, now: float) -> None:
        cutoff = now - max(self.config.cooldown_s, 3600.0)
        for lineage in [k for k, at in self.moved.items() if at < cutoff]:
            del self.moved[lineage]
        for uid in [k for k, at in self.counted.items() if at < cutoff]:
            del self.counted[uid]


def job_kind(movers: Movers) -> WatchedKind:
    """The Jobs (batch/v1) `movers` follows, as a watched kind: whether each tolerates a disruption. A
    refused LIST (a ClusterRole without batch jobs) is a warning: Jobs' pods then move only with the
    annotation."""

    def list_failed(exc: ApiError) -> bool:
        log.warning("listing Jobs failed (%s): a Job's pods move to defragment only with gpupool.io/movable",
                    exc)
        return True

    return WatchedKind("jobs", JOBS, movers.on_job, on_error=list_failed)


def _by_name(key: str) -> str:
    """The cooldown's key for a StatefulSet's pod by its name (its ordinal): its next pod has the same."""
    return f"pod:{key}"


def _holds_gpus(entry: PodEntry) -> bool:
    return any(part.gpu_indices or part.mig_devices for part in entry.placement.parts())
