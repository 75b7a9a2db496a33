"""The scheduler's ledger (`ClusterState`) driven in-process, without the service around it: one scheduling
cycle for a pod (best-fit), and what a node has left per GPU."""

from __future__ import annotations

from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.model.decision import Placement
from gpupool_sched.placement.registry import build_policy


def free_gpus(state: ClusterState, node: str) -> list[int]:
    """The node's free milli-GPUs, GPU by GPU."""
    i = state.snapshot.index[node]
    n = len(state.nodes[node].spec.gpus)
    return [int(x) for x in state.snapshot.free_milli[i, :n]]


def schedule(state: ClusterState, obj: dict[str, Any]) -> Placement:
    """The pod's placement by one cycle of the best-fit policy (assumed in `state`); it must fit."""
    plan = state.plan(obj)
    result = Cycle(state, lambda: build_policy("best-fit")).schedule(plan)
    assert result.statement is not None, result.unschedulable
    return result.statement.placements[0][1]
