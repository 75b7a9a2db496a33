"""Synthetic gangs in the time simulator (`--gangs SHARE:SIZE`): a seeded share of the training-shaped
arrivals (pods asking for 2 or more GPUs) arrive as a gang of SIZE pods of that shape, a PodGroup with
minMember = SIZE, decided as the scheduler service decides a PodGroup's job.

Rules (docs/simulator.md, "Gangs"):

* a gang's job is its waiting members, all of which must be placed together (`need` = how many wait, as
  the service's `Scheduling._job` counts minMember less the members already placed): one
  `Cycle.schedule_gang` call, with the running pods below its priority as eviction candidates (the
  service's `running_pods`); no consolidate (the service moves no pods for a gang);
* a gang preemption is carried out at once as a pod's is: the victims leave through the watch's deletion
  path (their room becomes the members' holds) and the gang's next cycle, at the same instant, takes it;
* every member gets the gang's lifetime from the moment the gang is placed whole; the gang leaves together;
* a waiting gang is retried when room frees on a node where one of its members fits by count (the rule of
  timeline.py), ranked with the waiting pods by priority, then arrival; it gives up after its patience
  (its pod's), all members at once;
* a member evicted by another's preemption is recreated by its controller and rejoins its gang: its job
  is the gang's missing members (as the service's), it runs until the gang's end (the simulator does not
  model a job's progress), and if the gang ends first it leaves the queue with it;
* members carry the PodGroup label, so the consolidate action never moves them (the service's `Movers`);
* the offered load stays `--load`: the arrival rate is divided by the factor gangs add to the mean GPU
  time of an arrival; the pre-fill is lone pods offering that load (gangs start with the run).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.gang_preemption import GangPreemption
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.pacing import gpu_seconds
from gpupool_sched.simulate.roomcount import fits_by_count
from gpupool_sched.simulate.timerecord import Decision

if TYPE_CHECKING:
    from gpupool_sched.framework.cycle import GangResult
    from gpupool_sched.kube.podspec import PodPlan
    from gpupool_sched.simulate.timeline import Job, Timeline

MAX_SIZE = 64


class GangSpecError(ValueError):
    """A --gangs value that does not parse: the one line the user sees."""


@dataclass(frozen=True, slots=True)
class GangSpec:
    share: float  # of the training-shaped arrivals, in (0, 1]
    size: int  # pods per gang, minMember = size

    @classmethod
    def parse(cls, text: str) -> GangSpec:
        """'SHARE:SIZE', e.g. '0.5:4'."""
        share_text, sep, size_text = text.strip().partition(":")
        if not sep:
            raise GangSpecError(f"--gangs {text!r}: expected SHARE:SIZE, e.g. 0.5:4")
        try:
            share = float(share_text)
        except ValueError:
            raise GangSpecError(f"--gangs {text!r}: SHARE {share_text!r} is not a number") from None
        if not 0 < share <= 1:
            raise GangSpecError(f"--gangs {text!r}: SHARE must be in (0, 1], got {share_text}")
        try:
            size = int(size_text)
        except ValueError:
            raise GangSpecError(f"--gangs {text!r}: SIZE {size_text!r} is not an integer") from None
        if not 2 <= size <= MAX_SIZE:
            raise GangSpecError(f"--gangs {text!r}: SIZE must be in 2..{MAX_SIZE}, got {size}")
        return cls(share, size)

    def __str__(self) -> str:
        return f"{self.share:g}:{self.size}"

    @staticmethod
    def training(pod: TimedPod) -> bool:
        """Training-shaped: asks for 2 or more GPUs."""
        return pod.request.gpu_count >= 2

    def load_factor(self, pods: Sequence[TimedPod]) -> float:
        """How much more GPU time an arrival offers on average once gangs are on (1 when no pod is training-
        shaped): the arrival rate is divided by it so that the offered load stays the same."""
        lone = sum(gpu_seconds(p) for p in pods)
        extra = sum(gpu_seconds(p) * self.share * (self.size - 1) for p in pods if self.training(p))
        return (lone + extra) / lone if lone > 0 else 1.0


@dataclass(frozen=True, slots=True)
class GangArrival:
    name: str  # the PodGroup's; member i is `<name>-<i>`
    pod: TimedPod  # each member's shape, priority, lifetime and patience
    size: int


@dataclass(slots=True)
class GangStats:
    arrived: int = 0
    placed: int = 0  # placed whole (each gang once)
    gave_up: int = 0
    preempting: int = 0  # gang decisions that evicted pods
    members_preempted: int = 0  # members evicted by another's preemption (they rejoin their gang)
    rejoined: int = 0  # such members placed again
    short_at_end: int = 0  # such members still waiting when their gang ended
    delays: list[float] = field(default_factory=list)  # arrival to placed whole, per placed gang

    def json(self, spec: GangSpec) -> dict[str, object]:
        if self.delays:
            p50, p99 = np.percentile(np.asarray(self.delays), [50, 99]).tolist()
        else:
            p50 = p99 = 0.0
        return {"share": spec.share, "size": spec.size, "arrived": self.arrived, "placed": self.placed,
                "gave_up": self.gave_up, "preempting_gangs": self.preempting,
                "members_preempted": self.members_preempted, "members_rejoined": self.rejoined,
                "members_short_at_end": self.short_at_end,
                "queueing_delay": {"placed": len(self.delays), "p50_s": round(p50, 1), "p99_s": round(p99, 1)}}


@dataclass(eq=False, slots=True)
class Gang:
    owner: TimeGangs
    name: str
    pod: TimedPod
    members: list[Job]  # the current attempt of each member
    seq: int  # its place in arrival order (a rejoin: the recreated member's)
    arrived: float
    end: float = 0.0  # when it leaves; 0 until it is placed whole
    queued: bool = False
    counted: int = 0  # its members in the timeline's queue length while it is queued

    @property
    def waiting(self) -> list[Job]:
        return [m for m in self.members if not m.running]

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.pod.request.priority, self.seq)

    def retry(self) -> bool:
        """Tried again out of a departure (timeline.retry_node): True when it runs whole now."""
        self.owner.dequeue(self)
        if self.owner.try_gang(self):
            return True
        self.owner.enqueue(self)
        return False


class TimeGangs:
    """The gangs of one timeline: their arrivals, decisions, queue and counters."""

    def __init__(self, timeline: Timeline, spec: GangSpec) -> None:
        self.timeline = timeline
        self.spec = spec
        self.stats = GangStats()
        self.queue: dict[int, Gang] = {}  # id -> waiting gang (some member waits)
        self.count = 0
        timeline.gangs = self

    # ---- arrivals ------------------------------------------------------------------------------------
    def arrivals(self, stream: Iterator[tuple[float, TimedPod]],
                 rng: np.random.Generator) -> Iterator[tuple[float, TimedPod]]:
        """`stream` with a seeded share of its training-shaped pods turned into gangs: each gang is handed to
        the timeline as an event at its arrival time; the lone pods pass through."""
        for at, pod in stream:
            if self.spec.training(pod) and rng.random() < self.spec.share:
                self.count += 1
                gang = GangArrival(f"{pod.request.name}-gang{self.count}", pod, self.spec.size)
                self.timeline.call_at(at, functools.partial(self.arrive, gang))
                continue
            yield at, pod

    def arrive(self, arrival: GangArrival) -> None:
        t = self.timeline
        members = [t.new_job(dataclasses.replace(arrival.pod, request=dataclasses.replace(
            arrival.pod.request, name=f"{arrival.name}-{i}")), t.now) for i in range(arrival.size)]
        t.stats.arrivals += arrival.size
        t.stats.offered_milli_s += arrival.size * arrival.pod.request.gpu_milli_total * arrival.pod.lifetime_s
        gang = Gang(self, arrival.name, arrival.pod, members, members[0].seq, t.now)
        for member in members:
            member.gang = gang
        self.stats.arrived += 1
        if not self.try_gang(gang):
            self.enqueue(gang)
            t.call_at(t.now + arrival.pod.patience_s, functools.partial(self.give_up, gang))

    # ---- decisions -----------------------------------------------------------------------------------
    def try_gang(self, gang: Gang) -> bool:
        """One cycle for the gang's waiting members (allocate, then preempt); True when it runs whole now."""
        t = self.timeline
        if gang.end and t.now >= gang.end:
            return False  # a rejoin whose gang is over
        result = self._cycle(gang)
        if result.statement is not None and result.statement.placements:
            self._placed(gang, result.statement.placements)
            return True
        if result.preemption is not None:
            return self._preempted_for(gang, result)
        return False

    def _cycle(self, gang: Gang) -> GangResult:
        """The service's gang path for the waiting members: all of them (`need`), lower pods as candidates."""
        t = self.timeline
        waiting = gang.waiting
        result = t.cycle.schedule_gang([m.plan for m in waiting], len(waiting), t.candidates_for(waiting[0]))
        t.stats.cycle_seconds += result.seconds
        return result

    def _preempted_for(self, gang: Gang, result: GangResult) -> bool:
        t = self.timeline
        preemption = result.preemption
        assert isinstance(preemption, GangPreemption)
        victims = [t.jobs[v.uid] for v in preemption.victims]
        nodes = sorted({v.node for v in preemption.victims})
        t.stats.preemptors += 1
        t.stats.preemptions += len(victims)
        self.stats.preempting += 1
        if t.record:
            t.decisions.append(Decision(t.now, gang.name, ",".join(nodes), (),
                                        tuple(sorted(v.pod.request.name for v in victims))))
        t.evict(victims)  # their room becomes the members' holds; the gang takes it now
        waiting = gang.waiting
        again = self._cycle(gang)
        placed = again.statement is not None and bool(again.statement.placements)
        if placed:
            assert again.statement is not None
            self._placed(gang, again.statement.placements)
        else:
            for member in waiting:
                t.state.end_nomination(member.plan.uid)  # never left holding room nobody takes
        t.requeue(victims)
        for node in nodes:
            t.retry_node(node)
        return placed

    def _placed(self, gang: Gang, placements: Sequence[tuple[PodPlan, Placement]]) -> None:
        t = self.timeline
        if not gang.end:  # placed whole for the first time: its lifetime starts
            gang.end = t.now + gang.pod.lifetime_s
            self.stats.placed += 1
            self.stats.delays.append(t.now - gang.arrived)
            t.call_at(gang.end, functools.partial(self._ended, gang))
        else:
            self.stats.rejoined += len(placements)
        by_uid = {m.plan.uid: m for m in gang.members}
        for plan, placement in placements:
            member = by_uid[plan.uid]
            member.pod = dataclasses.replace(member.pod, lifetime_s=gang.end - t.now)  # leaves with its gang
            t.placed_job(member, placement)
            entry = t.state.pods.get(plan.uid)
            if entry is not None:  # the label the watch would tell (the movers leave gang members alone)
                entry.labels = {POD_GROUP_LABEL: gang.name}

    def rejoin(self, evicted: Job) -> bool:
        """`evicted` was a member of a gang: its controller's new pod waits to rejoin it (False: not a member)."""
        gang = evicted.gang
        if gang is None:
            return False
        t = self.timeline
        self.stats.members_preempted += 1
        if t.now >= gang.end:
            return True  # its gang is over: nothing to rejoin
        redo = t.new_job(evicted.pod, t.now)
        redo.gang = gang
        gang.members = [redo if m is evicted else m for m in gang.members]
        if gang.queued:
            self.dequeue(gang)
        gang.seq = redo.seq
        self.enqueue(gang)
        return True

    # ---- the queue -----------------------------------------------------------------------------------
    def enqueue(self, gang: Gang) -> None:
        if gang.queued:  # a member evicted while the gang was tried again: counted afresh
            self.dequeue(gang)
        gang.queued, gang.counted = True, len(gang.waiting)
        self.queue[id(gang)] = gang
        self.timeline.queue_len += gang.counted

    def dequeue(self, gang: Gang) -> None:
        gang.queued = False
        del self.queue[id(gang)]
        self.timeline.queue_len -= gang.counted

    def head(self, cpu: int, mem: int, free: list[tuple[int, str]], failed: set[object]) -> Gang | None:
        """The first waiting gang (priority, then arrival) one of whose members fits on a node with `cpu`,
        `mem` and GPUs `free` ((free milli, model) each) by count; None when none does."""
        best: Gang | None = None
        for gang in self.queue.values():
            if gang in failed or (best is not None and gang.rank >= best.rank):
                continue
            r = gang.pod.request
            if fits_by_count(cpu, mem, free, r.cpu_milli, r.memory_mib, r.gpu_count, r.gpu_milli, r.gpu_models):
                best = gang
        return best

    def give_up(self, gang: Gang) -> None:
        """Its patience ran out: a gang never placed leaves the queue, every member at once."""
        if gang.queued and not gang.end:
            self.timeline.stats.gave_up += gang.counted
            self.dequeue(gang)
            self.stats.gave_up += 1

    def _ended(self, gang: Gang) -> None:
        """Its lifetime is over: the running members leave by their own departures; a member still waiting
        to rejoin leaves the queue."""
        if gang.queued:
            self.stats.short_at_end += gang.counted
            self.dequeue(gang)
