"""The simulator in time: pods arrive, run for their lifetime and leave; a pod that does not fit waits in a
queue until room frees up, it preempts, or its patience runs out.

Every decision is the scheduler service's own: a `framework.cycle.Cycle` over a `cache.state.ClusterState`
(nodes fed as `NodeView`s through `upsert_node`). A placement is the statement the cycle commits (assumed,
then marked bound as the binder does); a departure is `forget`; a preemption's victims leave through the
watch's deletion path (`apply_pod(..., deleted=True)`: what they held becomes holds for their preemptor),
and the preemptor's next cycle, at the same instant, takes the room. No second placement or preemption.

Events are a heap of (time, sequence) so that runs are deterministic per seed. A waiting pod is retried
when a departure (or a preemption) frees room on a node it could fit on by count (CPU, memory, GPUs with
enough free milli of an accepted model): nothing else frees room, so a pod that fitted nowhere before
cannot fit anywhere else now (kube-scheduler's queueing hints make the same argument). Waiting pods are
retried by priority, then in arrival order; a retry runs the whole cycle (allocate, then preempt). With
a `DefragConfig` on, it also runs consolidate (migrations: timemoves.py, the service's `Movers`). A waiting
gang (timegangs.py) is retried by the same rule when one of its members could fit on the freed node by count
(a gang that now fits must use the freed room), ranked with the pods by priority, then arrival.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle, CycleResult
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, running_pods
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.kube.podinfo import PodInfo
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.preemption import RunningPod
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.roomcount import fits_by_count
from gpupool_sched.simulate.timegangs import Gang, TimeGangs
from gpupool_sched.simulate.timemoves import EPOCH, Moves, owner_of
from gpupool_sched.simulate.timerecord import Decision, Sample

ARRIVE, DEPART, GIVE_UP, SAMPLE, CALL = 0, 1, 2, 3, 4
GroupKey = tuple[int, int, int, int, int, frozenset[str]]  # (-priority, cpu, memory, GPUs, milli, models)
NAMESPACE = "sim"


@dataclass(slots=True)
class Job:
    """One attempt of a trace pod: a pod object of its own (a preempted pod comes back as a new one, as
    its controller would recreate it)."""

    pod: TimedPod
    plan: PodPlan
    seq: int  # arrival order, for FIFO among equal priorities
    since: float  # waiting since (arrival, or requeue after a preemption)
    queued: bool = False
    running: bool = False
    end: float = 0.0  # when it leaves, while running
    started: float = 0.0
    moved: bool = False  # a migrated pod's replacement (not counted as placed again)
    gang: Gang | None = None  # the synthetic gang it is a member of (timegangs.py)


@dataclass
class TimeStats:
    """What a run measured between `start` and `end` (seconds of simulated time)."""

    start: float
    end: float
    capacity_milli: int
    allocated_milli_s: float = 0.0  # integral of allocated GPU milli over time
    idle_while_waiting_milli_s: float = 0.0  # integral of free GPU milli while the queue is not empty
    waiting_s: float = 0.0  # time with a non-empty queue
    queue_len_s: float = 0.0  # integral of the queue length
    arrivals: int = 0
    placed: int = 0
    gave_up: int = 0
    preemptions: int = 0  # pods evicted by a preemption (each goes back to the queue)
    preemptors: int = 0  # decisions that evicted
    migrations: int = 0  # pods moved by the consolidate action (--defrag on; not preemptions)
    migrated_for: int = 0  # pods that pods were moved for
    misplaced: int = 0  # movers' replacements that did not land on their reserved destination
    events: int = 0
    offered_milli_s: float = 0.0  # GPU milli x lifetime of every arrival (what the load asks)
    delays: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # class -> waits of placed pods
    samples: list[Sample] = field(default_factory=list)
    prefilled: int = 0
    prefill_dropped: int = 0
    seconds: float = 0.0  # wall time
    cycle_seconds: float = 0.0  # of which in the placement core


Arrivals = Iterator[tuple[float, TimedPod]]
Fragmentation = Callable[[ClusterState], float]  # fragmented GPU milli of the cluster


class Timeline:
    """One run: nodes, a policy and a stream of arrivals. `prefill`: pods already running at time 0 with
    their remaining lifetimes (placed in the given order, no preemption; those that fit nowhere are
    dropped and counted). `record`: keep every decision (tests). `defrag`: the consolidate action's settings
    (the service's `--defrag*`; None or off: no pod moves)."""

    def __init__(self, nodes: Sequence[NodeView], policy: Callable[[], Policy], *, seed: int = 0,
                 record: bool = False, defrag: DefragConfig | None = None) -> None:
        self.now = 0.0
        self.state = ClusterState("gpupool", clock=lambda: self.now)
        for view in nodes:
            self.state.upsert_node(view)
        self.cycle = Cycle(self.state, policy, seed=seed)
        self.budgets = DisruptionBudgets()
        self.capacity_milli = sum(1000 * len(v.spec.gpus) for v in nodes)
        self.allocated_milli = 0
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.jobs: dict[str, Job] = {}  # uid -> job, while it waits or runs
        # waiting pods grouped by what they ask (same request, same priority): one fit check per group
        self.groups: dict[GroupKey, dict[str, Job]] = {}
        self.queue_len = 0
        self.attempts: dict[str, int] = defaultdict(int)
        self.record = record
        self.decisions: list[Decision] = []
        self.stats = TimeStats(0.0, 0.0, self.capacity_milli)
        self._last = 0.0
        self._arrivals: Arrivals | None = None
        self.moves = Moves(self, defrag) if defrag is not None and defrag.enabled else None
        self.gangs: TimeGangs | None = None  # synthetic gangs (timegangs.py; --gangs)

    # ---- events ----------------------------------------------------------------------------------
    def _push(self, at: float, kind: int, what: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, what))

    def call_at(self, at: float, what: Callable[[], None]) -> None:  # timemoves.py's retries
        self._push(at, CALL, what)

    def new_job(self, pod: TimedPod, since: float, *, moved: bool = False) -> Job:
        name = pod.request.name
        self.attempts[name] += 1
        uid = f"{name}#{self.attempts[name]}"
        plan = PodPlan(uid, NAMESPACE, name, since, pod.request.priority, pod.request, (), 1024,
                       owner_of(NAMESPACE, name))
        self.seq += 1
        return Job(pod, plan, self.seq, since, moved=moved)

    def prefill(self, pods: Sequence[tuple[TimedPod, float]]) -> None:
        """Pods running at time 0, each with its remaining lifetime."""
        for pod, remaining in pods:
            job = self.new_job(pod, 0.0)
            result = self.cycle.schedule(job.plan)
            if result.statement is None or not result.statement.placements:
                self.stats.prefill_dropped += 1
                continue
            self._started(job, result.statement.placements[0][1], remaining, record=False,
                          age=max(0.0, job.pod.lifetime_s - remaining))
            self.stats.prefilled += 1

    def run(self, arrivals: Arrivals, until: float, *, samples: int = 0,
            fragmentation: Fragmentation | None = None, progress: Callable[[float], None] | None = None) -> TimeStats:
        """Run the events up to `until` (simulated seconds) and return what was measured over [now, until].
        `samples`: this many evenly spaced points of allocation, queue length (and fragmentation) over time."""
        wall = time.perf_counter()
        stats = self.stats
        stats.start, stats.end = self.now, until
        self._last = self.now
        self._arrivals = arrivals
        self._next_arrival()
        for k in range(samples):
            self._push(self.now + (until - self.now) * (k + 1) / samples, SAMPLE, None)
        heap = self.heap
        while heap and heap[0][0] <= until:
            at, _, kind, what = heapq.heappop(heap)
            self._advance(at)
            stats.events += 1
            if kind == DEPART:
                self._depart(what)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                stats.arrivals += 1
                stats.offered_milli_s += what.request.gpu_milli_total * what.lifetime_s  # type: ignore[attr-defined]
                if progress is not None and not stats.arrivals % 4096:
                    progress(at)
                self._arrive(what)  # type: ignore[arg-type]
                self._next_arrival()
            elif kind == GIVE_UP:
                self._give_up(what)  # type: ignore[arg-type]
            elif kind == CALL:
                what()  # type: ignore[operator]
            else:
                frag = None if fragmentation is None else 100 * fragmentation(self.state) / self.capacity_milli
                stats.samples.append(Sample(at, 100 * self.allocated_milli / self.capacity_milli, self.queue_len, frag))
                stats.events -= 1
        self._advance(until)
        if progress is not None:
            progress(until)
        stats.seconds += time.perf_counter() - wall
        return stats

    def _next_arrival(self) -> None:
        item = next(self._arrivals, None) if self._arrivals is not None else None
        if item is not None:
            self._push(item[0], ARRIVE, item[1])

    def _advance(self, at: float) -> None:
        dt = at - self._last
        if dt > 0:
            s = self.stats
            s.allocated_milli_s += self.allocated_milli * dt
            if self.queue_len:
                s.waiting_s += dt
                s.queue_len_s += self.queue_len * dt
                s.idle_while_waiting_milli_s += (self.capacity_milli - self.allocated_milli) * dt
            self._last = at
        self.now = at

    # ---- what happens to a pod -----------------------------------------------------------------------
    def _arrive(self, pod: TimedPod) -> None:
        job = self.new_job(pod, self.now)
        if not self.try_job(job):
            self.enqueue_job(job)

    def try_job(self, job: Job) -> bool:
        """One cycle for the job (allocate, consolidate when on, then preempt); True when it runs now."""
        moves, offer = self.moves, None
        if moves is None:
            result = self.cycle.schedule(job.plan, self.candidates_for(job))
        else:
            result, offer = moves.decide(job, self.candidates_for(job))
        self.stats.cycle_seconds += result.seconds
        if result.statement is not None and result.statement.placements:
            self.placed_job(job, result.statement.placements[0][1])
            return True
        if result.preemption is not None:
            return self._preempted_for(job, result)
        return moves is not None and offer is not None and moves.not_placed(job, result, offer)

    def retry_job(self, job: Job) -> None:
        """A waiting job tried again out of turn (its wait for moves is over): back in its place if not placed."""
        self.dequeue_job(job)
        if not self.try_job(job):
            self.enqueue_back(job)

    def candidates_for(self, job: Job) -> Callable[[], list[RunningPod]]:
        """Its eviction candidates, as the service passes them: running pods below its priority."""
        floor = job.plan.priority
        return lambda: running_pods(self.state, self.budgets, floor)

    def _preempted_for(self, job: Job, result: CycleResult) -> bool:
        assert result.preemption is not None
        victims = [self.jobs[v.uid] for v in result.preemption.victims]
        self.stats.preemptors += 1
        self.stats.preemptions += len(victims)
        if self.record:
            self.decisions.append(Decision(self.now, job.pod.request.name, result.preemption.node, (),
                                           tuple(sorted(v.pod.request.name for v in victims))))
        node = result.preemption.node
        placed = self.evict_and_take(job, victims)
        self.requeue(victims)
        self.retry_node(node)
        return placed

    def requeue(self, evicted: Sequence[Job]) -> None:
        """Back to the queue, as their controller recreates them: a new pod, from scratch (a gang member rejoins
        its gang: timegangs.py)."""
        for victim in evicted:
            if self.gangs is None or not self.gangs.rejoin(victim):
                self.enqueue_job(self.new_job(victim.pod, self.now))

    def evict(self, evicted: Sequence[Job]) -> None:
        """`evicted` leave by the watch's deletion path (their room becomes holds for those they were evicted for)."""
        for gone in evicted:
            self.leave_job(gone)
            self.state.apply_pod(PodInfo.of({"metadata": {"uid": gone.plan.uid}}), deleted=True)

    def evict_and_take(self, job: Job, evicted: Sequence[Job]) -> bool:
        """`evicted` leave by the watch's deletion path (their room held for `job`); `job` takes it now: True."""
        self.evict(evicted)
        again = self.cycle.schedule(job.plan, self.candidates_for(job))
        self.stats.cycle_seconds += again.seconds
        if again.statement is not None and again.statement.placements:
            self.placed_job(job, again.statement.placements[0][1])
            return True
        self.state.end_nomination(job.plan.uid)  # never left holding room nobody takes
        return False

    def placed_job(self, job: Job, placement: Placement) -> None:
        if not job.moved:  # a replacement was placed (and its wait counted) as the pod it replaces
            self.stats.placed += 1
            self.stats.delays[job.pod.priority_class].append(self.now - job.since)
        self._started(job, placement, job.pod.lifetime_s, record=self.record)

    def _started(self, job: Job, placement: Placement, lifetime: float, *, record: bool, age: float = 0.0) -> None:
        self.state.mark_bound(job.plan.uid)  # the binder's answer: a candidate for preemption from now on
        entry = self.state.pods.get(job.plan.uid)
        if entry is not None:  # status.startTime, as the watch tells it (wall clock: timemoves.EPOCH)
            entry.started = EPOCH + self.now - age
        job.running, job.started, job.end = True, self.now, self.now + lifetime
        self.jobs[job.plan.uid] = job
        self.allocated_milli += job.pod.request.gpu_milli_total
        self._push(job.end, DEPART, job)
        if record:
            self.decisions.append(Decision(self.now, job.pod.request.name, placement.node, placement.gpu_indices))

    def leave_job(self, job: Job) -> None:
        job.running = False
        del self.jobs[job.plan.uid]
        self.allocated_milli -= job.pod.request.gpu_milli_total

    def record_migration(self, job: Job, node: str, moves: list[tuple[Job, Placement]]) -> None:
        if self.record:
            self.decisions.append(Decision(self.now, job.pod.request.name, node, (), (), tuple(
                (m.pod.request.name, d.node, d.gpu_indices) for m, d in moves)))

    def _depart(self, job: Job) -> None:
        if not job.running:
            return  # preempted before its end
        self.leave_job(job)
        entry = self.state.forget(job.plan.uid)
        if entry is not None:
            self.retry_node(entry.node)
            if self.moves is not None and job.pod.request.gpu_milli_total:
                self.moves.freed()

    def _give_up(self, job: Job) -> None:
        if job.queued:
            self.dequeue_job(job)
            self.stats.gave_up += 1

    # ---- the queue -------------------------------------------------------------------------------
    @staticmethod
    def _group(job: Job) -> GroupKey:
        r = job.pod.request
        return (-r.priority, r.cpu_milli, r.memory_mib, r.gpu_count, r.gpu_milli, r.gpu_models)

    def enqueue_job(self, job: Job) -> None:
        job.queued = True
        self.groups.setdefault(self._group(job), {})[job.plan.uid] = job
        self.queue_len += 1
        self._push(job.since + job.pod.patience_s, GIVE_UP, job)

    def dequeue_job(self, job: Job) -> None:
        job.queued = False
        key = self._group(job)
        group = self.groups[key]
        del group[job.plan.uid]
        if not group:
            del self.groups[key]
        self.queue_len -= 1

    def retry_node(self, node: str) -> None:
        """Room freed on `node`: the waiting pods that could fit there by count, most important first, then
        the longest waiting, each through a whole cycle."""
        if not self.queue_len:
            return
        snapshot = self.state.snapshot
        row = snapshot.index.get(node)
        if row is None:
            return
        spec = self.state.nodes[node].spec
        failed: set[object] = set()  # groups (GroupKey) and gangs that did not fit
        while True:
            cpu, mem = int(snapshot.cpu_free[row]), int(snapshot.mem_free[row])
            free = [(int(snapshot.free_milli[row, j]), g.model) for j, g in enumerate(spec.gpus)
                    if snapshot.gpu_usable[row, j]]
            best: Job | None = None
            for key, group in self.groups.items():
                if key in failed:
                    continue
                if not fits_by_count(cpu, mem, free, *key[1:]):
                    continue
                head = next(iter(group.values()))
                if best is None or (key[0], head.seq) < (self._group(best)[0], best.seq):
                    best = head
            gang = None if self.gangs is None else self.gangs.head(cpu, mem, free, failed)
            if gang is not None and (best is None or gang.rank < (self._group(best)[0], best.seq)):
                if not gang.retry():
                    failed.add(gang)
                continue
            if best is None:
                return
            self.dequeue_job(best)
            if not self.try_job(best):
                failed.add(self._group(best))
                self.enqueue_back(best)

    def enqueue_back(self, job: Job) -> None:
        """A retried job that still does not fit: back in its place (its give-up event is already set)."""
        job.queued = True
        group = self.groups.setdefault(self._group(job), {})
        group[job.plan.uid] = job
        # keep arrival order within the group: it was the head, put it first again
        if next(iter(group)) != job.plan.uid:
            items = sorted(group.values(), key=lambda j: j.seq)
            group.clear()
            group.update((j.plan.uid, j) for j in items)
        self.queue_len += 1
