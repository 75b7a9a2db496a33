"""Node watch events into the ledger and the workload profile, as the scheduler and the extender both
take them (a node's GPUs weigh in the profile's view of the cluster)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import ClusterEvent
from gpupool_sched.placement.workload import RollingProfile


@dataclass(frozen=True, slots=True)
class NodeChange:
    """A node event that changed the ledger; `event`: what it means to pending pods (None: deleted)."""

    name: str
    event: ClusterEvent | None


def apply_node_event(state: ClusterState, profile: RollingProfile, kind: str | None,
                     obj: dict[str, Any]) -> NodeChange | None:
    """Apply a node event (`kind` DELETED, or any other: listed, added, changed); None when it changed
    nothing that matters (or names no node)."""
    name = (obj.get("metadata") or {}).get("name")
    if not name:
        return None
    if kind == "DELETED":
        state.delete_node(name)
        profile.node_changed(name, None)
        return NodeChange(name, None)
    event = state.apply_node(obj)
    if event is None:
        return None
    profile.node_changed(name, state.node_spec(name))
    return NodeChange(name, event)
