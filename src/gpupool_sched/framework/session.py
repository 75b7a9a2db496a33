"""One decision for one job: what its actions read (the cache, the policy resolved once, the random
stream, the node sampler, the job's eviction candidates) and what they leave for the next action.

Long planning (preemption, reclaim) is a `Planning`: prepared on the scheduler's loop, computed by a pure
function that may run on a worker thread against its own copy of the snapshot (`offload`), and applied
on the loop after checking that what it relied on still holds. An action that needs one yields it; the
driver (`drive` inline, `drive_offloaded` on a thread) sends its answer back. The watch keeps being
served while a plan is computed off the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.model.decision import Unschedulable
from gpupool_sched.placement.candidates import CandidateBudget
from gpupool_sched.placement.consolidation import Consolidation, Movable
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.gang import GangUnschedulable
from gpupool_sched.placement.gang_preemption import GangPreemption
from gpupool_sched.placement.preemption import Preemption, RunningPod
from gpupool_sched.placement.preemption_memo import PreemptionMemo
from gpupool_sched.placement.sampling import NodeSampler

if TYPE_CHECKING:
    from gpupool_sched.framework.statement import Statement

T = TypeVar("T")
Candidates = Callable[[], list[RunningPod]]
Movers = Callable[[], list[Movable]]


@dataclass
class Planning(Generic[T]):
    """A pure computation an action waits for: `compute()` may run on another thread."""

    compute: Callable[[], T]


Steps = Generator[Planning[Any], Any, T]


def drive(steps: Steps[T]) -> T:
    """Run `steps` to the end, computing each planning inline."""
    try:
        planning = next(steps)
        while True:
            planning = steps.send(planning.compute())
    except StopIteration as done:
        return done.value


async def drive_offloaded(steps: Steps[T]) -> T:
    """Run `steps` to the end, computing each planning on a worker thread (the loop serves the watch)."""
    try:
        planning = next(steps)
        while True:
            answer = await asyncio.to_thread(planning.compute)
            planning = steps.send(answer)
    except StopIteration as done:
        return done.value


@dataclass(frozen=True)
class IdleVictims:
    """What the reclaim-idle action may evict for a job: pods idle past their policy's idleAfter
    (framework/plugins/idle.py chose them), the priority the plan is made with, and why the job is
    entitled (for the Events)."""

    candidates: list[RunningPod]
    priority: int
    entitled: str  # "within its guarantee of GpuQuota q" or "priority P > p"
    whole: Callable[[Iterable[str]], bool]  # these victims take no gang member without its whole gang
    idle_since: dict[str, float]  # candidate UID -> idle since (epoch s)
    on_blocked: Callable[[], None] = lambda: None  # the plan needed PDB-protected idle pods (metrics)


IdleCandidates = Callable[[], IdleVictims | None]


@dataclass
class Outcome:
    """What the job's actions decided. `statement` committed: placements (allocate) or evictions with
    nominations (preempt, reclaim); None: nothing changed."""

    statement: Statement | None = None  # committed
    preemption: Preemption | GangPreemption | None = None  # what the evictions are
    blocked_by_budget: Preemption | GangPreemption | None = None  # the plan needs PDB-protected victims: waits
    reclaim: bool = False  # the evictions take back borrowed quota (victims of any priority)
    stale: bool = False  # an off-loop plan no longer held when it came back: nothing done, try again
    migration: Consolidation | None = None  # the statement's evictions move these pods (consolidate)
    # a move would place the job but it may not move pods yet (`Session.moves_later`): nothing done, and
    # no preemption either (moving is tried first); it is tried again once it may
    deferred: Consolidation | None = None
    give_back: bool = False  # the evictions are borrowed replicas given back (scale-down, not eviction)
    idle: IdleVictims | None = None  # the evictions take idle pods (reclaim-idle)


@dataclass
class Session:
    state: ClusterState
    plans: list[PodPlan]  # the members to decide for (one for a lone pod)
    need: int  # how many must be placed together
    gang: bool  # a PodGroup (place_gang, plan_gang_preemption) or a lone pod (decide, plan_preemption)
    policy: Policy
    rng: np.random.Generator
    sampler: NodeSampler | None
    running: Candidates | None  # eviction candidates by priority; None: the job may not preempt
    reclaim: Candidates | None  # borrowed pods its team may take back; None: no reclaim
    hold_s: Callable[[Iterable[str]], float]  # how long a nomination holds for its victims
    max_preemptions: int
    offload: bool = False  # plannings run on another thread: they get their own snapshot copy
    candidates: CandidateBudget | None = None  # how many viable nodes end a preemption search (None: default)
    movable: Movers | None = None  # pods the job may move (consolidate); None: it may not (yet)
    max_movers: int = 16
    busy: Callable[[], set[str]] | None = None  # nodes a migration is under way on
    seconds: float = 0.0  # time in the placement core
    unschedulable: Unschedulable | GangUnschedulable | None = None  # why allocate found no room
    moves_later: bool = False  # `movable` is for a look only: the job has not waited --defrag-after yet
    borrowed: Candidates | None = None  # borrowed replicas the job may take back (give-back); None: none
    idle: IdleCandidates | None = None  # idle pods the job may take (reclaim-idle); None: none
    memo: PreemptionMemo | None = None  # what earlier preemption plans found per node (the cycle's)

    @property
    def priority(self) -> int:
        return min(p.priority for p in self.plans)
