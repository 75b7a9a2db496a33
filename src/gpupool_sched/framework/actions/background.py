"""Background consolidation: with no pod waiting, move movable shared tenants so that a partly used GPU
comes free whole (`placement.background.plan_background`, pure: every tenant of the GPU with a destination
on another partly used GPU, only when whole free GPUs go up and FGD does not). Not one of the per-pod
actions of `ACTIONS` (there is no pending pod): the scheduler's housekeeping calls it (scheduler/defrag.py)
when the background mode allows, at most one such migration at a time cluster-wide.

The same plugin decides who may move and the budgets as for a blocked pod (framework/plugins/movers.py:
movable kind, min-runtime, cooldown, PodDisruptionBudgets, the hourly budget caps the movers), never from
or towards a node where a migration is under way. The statement holds everything before any eviction: each
mover is marked as moving for the migration `purpose` (never chosen again) and its destination reserved for
its replacement. The writer then evicts the movers (writer/migrator.py `carry_out_background`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.movers import Movers
from gpupool_sched.framework.statement import Statement
from gpupool_sched.placement.background import Gathering, plan_background
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.preemption import count_down

NAME = "background-consolidate"
REPLACEMENT_WINDOW_S = 120.0  # as the consolidate action's: a reservation lasts the grace + slack + this
ANY_PRIORITY = 2**31  # no pod waits: tenants of every priority may move


def run(state: ClusterState, movers: Movers, policy: Policy, profile: WorkloadProfile | None, purpose: str,
        hold_s: Callable[[Iterable[str]], float]) -> Gathering | None:
    """Plan one gathering and hold it (movers marked for `purpose`, destinations reserved); None when there
    is nothing to gain, nothing may move, or the budget is spent."""
    budget = movers.budget_left()
    if budget <= 0:
        return None
    movable = movers.candidates(ANY_PRIORITY)  # only pods this scheduler places (`Movers.candidates`)
    if not movable:
        return None
    found = plan_background(state.snapshot, movable, policy, profile=profile, busy=frozenset(state.migrating_nodes()),
                            max_movers=min(movers.config.max_movers, budget))
    if found is None or not found.moves or any(count_down([m.pod for m in found.moves])):
        return None
    with Statement(state) as statement:
        for move in found.moves:
            statement.move(purpose, state.pods[move.pod.uid], move.destination,
                           hold_s((move.pod.uid,)) + REPLACEMENT_WINDOW_S)
        statement.commit()
    return found
