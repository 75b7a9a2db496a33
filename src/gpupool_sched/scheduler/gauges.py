"""The scheduler's gauges, set at each housekeeping tick from the ledger, the queue and the snapshot
(the costly ones, per node and cluster-wide fragmentation, every few ticks)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.queue import SchedulingQueue
from gpupool_sched.metrics import GPU_STATES, SchedulerMetrics, gpu_states
from gpupool_sched.placement.fragmentation import WorkloadProfile, cluster_fragmentation_milli


class Gauges:
    def __init__(self, metrics: SchedulerMetrics, state: ClusterState, queue: SchedulingQueue,
                 is_leader: Callable[[], bool], profile: Callable[[], WorkloadProfile], memory_unit_mib: int) -> None:
        self.metrics, self.state, self.queue = metrics, state, queue
        self.is_leader, self.profile, self.memory_unit_mib = is_leader, profile, memory_unit_mib
        self._per_node: dict[str, tuple[Any, Any]] = {}  # node -> its gpus_bound, memory_units_bound children

    def set(self, full: bool) -> None:
        m = self.metrics
        m.nominations.set(len(self.state.nominations))
        m.leader.set(1 if self.is_leader() else 0)
        m.queue_length.clear()
        for (queue, priority), n in self.queue.lengths().items():
            m.queue_length.labels(queue=queue, priority=str(priority)).set(n)
        phases = Counter(e.phase.value for e in self.state.pods.values())
        for phase in Phase:
            m.ledger.labels(phase=phase.value).set(phases.get(phase.value, 0))
        m.gate_timeouts.set(self.state.gate_timeouts)
        if full:
            self._set_full()

    def _set_full(self) -> None:
        m = self.metrics
        m.pending_oldest_age.clear()
        wall = time.time()
        for priority, created in self.queue.oldest_created_by_priority().items():
            m.pending_oldest_age.labels(priority=str(priority)).set(max(0.0, wall - created))
        gpus: Counter[str] = Counter()
        units: Counter[str] = Counter()
        unit = self.memory_unit_mib
        for e in self.state.pods.values():
            for part in (e.placement, *e.placement.extras):
                if part.gpu_indices and part.gpu_milli >= 1000:
                    gpus[e.node] += len(part.gpu_indices)
                elif part.gpu_memory_mib and part.gpu_indices:
                    units[e.node] += part.gpu_memory_mib // unit
        views = self.state.nodes.values()
        health = Counter("healthy" if g.healthy else "unhealthy" for v in views for g in v.spec.gpus)
        for state in ("healthy", "unhealthy"):
            m.gpus.labels(health=state).set(health.get(state, 0))
        by_state = gpu_states(self.state)
        for state in GPU_STATES:
            m.cluster_gpus.labels(state=state).set(by_state.get(state, 0))
        children = self._per_node  # labels() per node and tick would cost more than the rest together
        for node in [n for n in children if n not in self.state.nodes]:
            del children[node]
            m.gpus_bound.remove(node)
            m.memory_units_bound.remove(node)
        for node in self.state.nodes:
            pair = children.get(node)
            if pair is None:
                pair = children[node] = (m.gpus_bound.labels(node=node), m.memory_units_bound.labels(node=node))
            pair[0].set(gpus.get(node, 0))
            pair[1].set(units.get(node, 0))
        snap = self.state.snapshot
        total = snap.total_gpu_milli
        if total:
            m.gpu_allocated.set(100.0 * snap.used_gpu_milli() / total)
            frag = cluster_fragmentation_milli(snap, self.profile())
            m.fragmentation.set(100.0 * frag / total)
