"""The ledger: every pod that holds (or is about to hold) resources on a node, keyed by UID, accounted on
one `ClusterSnapshot` that the ledger alone writes; the facts pods are planned against; the views the
cycle and preemption read."""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gpupool_sched.cache.entries import Nomination, Phase, PodEntry, Shape, Tombstone, fits_layout, without_gpus
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import ClusterFacts, PodPlan
from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement

if TYPE_CHECKING:
    from gpupool_sched.cache.reservations import Reservation

log = logging.getLogger(__name__)
_LIVE = (Phase.BOUND, Phase.CONFIRMED)  # the phases of a pod that runs (an eviction candidate)


class Ledger:
    def __init__(
        self,
        scheduler_name: str,
        *,
        memory_unit_mib: int = 1024,
        gate_timeout_s: float = 30.0,
        confirm_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler_name = scheduler_name
        self.memory_unit_mib = memory_unit_mib
        self.gate_timeout_s = gate_timeout_s
        self.confirm_ttl_s = confirm_ttl_s
        self.clock = clock
        self.snapshot = ClusterSnapshot([])
        self.nodes: dict[str, NodeView] = {}
        self._node_signature: dict[str, tuple[Any, ...]] = {}
        self._node_rv: dict[str, int] = {}
        self.pods: dict[str, PodEntry] = {}
        self.by_node: dict[str, set[str]] = defaultdict(set)
        self._tombstones: dict[str, Tombstone] = {}
        self._pod_rv: dict[str, int] = {}
        self.priority_classes: dict[str, int] = {}
        self.classes_generation = 0  # bumped on every PriorityClass change (plans made before are stale)
        self._facts: ClusterFacts | None = None
        self.on_gate_release: Callable[[str], None] = lambda node: None
        self.on_claimed: Callable[[Reservation], None] = lambda reservation: None  # a replacement placed
        # priority -> {id(entry): entry} of every accounted entry (`_apply`/`_unapply` keep it): preemption's
        # candidates below a priority without a pass over the whole ledger (keyed by id: a hold keeps its
        # entry but takes a new UID)
        self._accounted: dict[int, dict[int, PodEntry]] = {}
        self._gate_load: dict[Shape, dict[str, int]] = defaultdict(dict)  # shape -> node -> pods in its gate
        self.gate_timeouts = 0
        self.unknown_devices = 0  # bound pods whose GPUs could not be told (accounted by a guess)
        self.nominations: dict[str, Nomination] = {}  # preemptor UID -> its nomination
        self.reservations: dict[str, Reservation] = {}  # RESERVED entry UID -> a migration's destination
        self.replaced: dict[str, str] = {}  # replacement UID -> UID of the first pod it replaces (cooldown)
        # node -> {pod UID: idle since (epoch s)}: its device plugin's gpupool.io/idle-pods, replaced whole at
        # each change (a pod the node no longer lists is busy again at once); absent or malformed: none
        self.idle_pods: dict[str, dict[str, float]] = {}
        self._idle_text: dict[str, str | None] = {}  # node -> the annotation last read
        self.on_idle_invalid: Callable[[str, str], None] = lambda node, problem: None  # (metric)
        self.marks: dict[str, str] = {}  # replacement UID -> its gpupool.io/moved annotation, until bound
        self.surging: dict[str, tuple[str, str]] = {}  # mover UID -> (its node, destination): a surge under way
        self.non_preempting_classes: set[str] = set()  # PriorityClasses with preemptionPolicy: Never
        self.preemptions: dict[str, int] = {}  # pending pod UID -> preemptions it started (a storm bound)
        self._nominated_on: dict[str, str] = {}  # preemptor UID -> node of its latest nomination, ours or adopted
        # called with an entry whenever it joins or leaves `pods` or what it holds changes (QuotaBook's usage)
        self.watchers: list[Callable[[PodEntry], None]] = []

    # ---- facts for planning pods ----------------------------------------------------------------
    @property
    def facts(self) -> ClusterFacts:
        if self._facts is None:
            models: set[str] = set()
            profiles: set[str] = set()
            units = 0
            for view in self.nodes.values():
                for gpu in view.spec.gpus:
                    models.add(gpu.model)
                    profiles.update(s.profile for s in gpu.mig_slices)
                    if view.memory_shares and not gpu.mig_enabled:
                        units = max(units, gpu.memory_mib // self.memory_unit_mib)
            self._facts = ClusterFacts(self.memory_unit_mib, frozenset(models), frozenset(profiles), units)
        return self._facts

    def plan(self, pod: PodInfo | Mapping[str, Any], strict: bool = True) -> PodPlan:
        """A pod as placement sees it (raises InvalidPod with the user-facing reason); a `PodInfo` keeps
        the plan for the next call while the facts and PriorityClasses stay the same. ``strict=False``:
        a bound pod, described as well as it can be (`plan_pod`)."""
        info = pod if isinstance(pod, PodInfo) else PodInfo.of(pod)
        return info.plan(self.facts, self.priority_classes, self.classes_generation, strict)


    def _tell(self, entry: PodEntry) -> None:
        """`entry` joined or left `pods`, or what it holds changed: the watchers recount it."""
        for watcher in self.watchers:
            watcher(entry)

    def running(self, below: int | None = None) -> Iterator[PodEntry]:
        """Entries preemption may choose victims from: bound or confirmed, accounted, not being evicted;
        with `below`, only those of lower priority (from the accounted entries by priority, not in ledger
        order)."""
        if below is None:
            entries: Iterable[PodEntry] = self.pods.values()
        else:
            entries = itertools.chain.from_iterable(
                bucket.values() for p, bucket in self._accounted.items() if p < below)
        # a list built in one comprehension, not a generator: preemption reads thousands per plan
        return iter([e for e in entries if e.phase in _LIVE and e.applied and e.evicting_for is None])

    def mark_bound(self, uid: str) -> None:
        entry = self.pods.get(uid)
        if entry is not None and entry.phase is Phase.ASSUMED:
            entry.phase = Phase.BOUND
            entry.since = self.clock()

    def expire(self) -> list[PodEntry]:
        """BOUND entries the watch has not confirmed within `confirm_ttl_s`: marked `uncertain` and
        returned for a read of the pod (kube-scheduler forgets them; a watch gap would then free GPUs
        in use). Old tombstones go."""
        now = self.clock()
        stale = [e for e in self.pods.values()
                 if e.phase is Phase.BOUND and not e.uncertain and now - e.since > self.confirm_ttl_s]
        for entry in stale:
            log.warning("pod %s: bound %.0fs ago but never seen bound; reading it", entry.key, now - entry.since)
            entry.uncertain = True
        cutoff = now - 600.0
        for uid in [u for u, t in self._tombstones.items() if t.at < cutoff]:
            del self._tombstones[uid]
        return stale

    def mark_uncertain(self, uid: str) -> PodEntry | None:
        """The Binding of `uid` may or may not have landed: keep what it holds until a read says."""
        entry = self.pods.get(uid)
        if entry is not None and entry.phase is not Phase.CONFIRMED:
            entry.uncertain = True
        return entry

    # ---- accounting ------------------------------------------------------------------------------
    def _apply(self, entry: PodEntry) -> None:
        if entry.applied or entry.node not in self.nodes:
            return
        spec = self.nodes[entry.node].spec
        if not fits_layout(entry.placement, spec):
            log.warning("pod %s holds devices node %s no longer has; accounting it without GPUs", entry.key, spec.name)
            entry.request, entry.placement = without_gpus(entry.request), Placement(node=entry.node)
            self._tell(entry)
        self.snapshot.assume(entry.request, entry.placement)
        entry.applied = True
        self._accounted.setdefault(entry.request.priority, {})[id(entry)] = entry

    def has_lower_priority(self, priority: int) -> bool:
        """Whether any accounted pod has a priority below `priority` (cheap: no victim search without)."""
        return any(p < priority and bucket for p, bucket in self._accounted.items())

    def _unapply(self, entry: PodEntry) -> None:
        if entry.applied and entry.node in self.nodes:
            self.snapshot.release(entry.request, entry.placement)
        self._unaccount(entry)

    def _unaccount(self, entry: PodEntry) -> None:
        """`entry` is no longer accounted (its node's row was reset, or `_unapply` released it)."""
        if entry.applied:
            bucket = self._accounted.get(entry.request.priority)
            if bucket is not None:  # kept when empty: the candidates keep their order (preemption's memo)
                bucket.pop(id(entry), None)
        entry.applied = False

    # ---- views -----------------------------------------------------------------------------------
    def entries(self, node: str | None = None) -> Iterator[PodEntry]:
        if node is None:
            yield from self.pods.values()
        else:
            for uid in self.by_node.get(node, ()):
                yield self.pods[uid]

    def node_spec(self, name: str) -> NodeSpec | None:
        view = self.nodes.get(name)
        return view.spec if view else None

    def is_gone(self, uid: str) -> bool:
        return uid in self._tombstones
