"""The scheduler's Prometheus metrics (names follow kube-scheduler's where one exists)."""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from gpupool_sched.cache.state import ClusterState

# ApiError.kind values, and the binder's own reasons
BIND_FAILURE_REASONS = ("conflict", "not_found", "forbidden", "invalid", "throttled", "server", "unreachable",
                        "other", "NodeGone", "NotLeader")
GPU_STATES = ("unhealthy", "mig", "whole", "shared", "free")  # gpupool_scheduler_cluster_gpus{state}

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ALGO_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


ELASTIC_HANDOVER_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.attempts = Counter(
            "gpupool_scheduler_schedule_attempts", "Scheduling attempts by result (scheduled, unschedulable, "
            "invalid, error)", ["result"], registry=r)
        self.e2e_latency = Histogram(
            "gpupool_scheduler_pod_scheduling_duration_seconds",
            "From the pod's creation to its Binding being accepted", buckets=_LATENCY_BUCKETS, registry=r)
        self.attempt_latency = Histogram(
            "gpupool_scheduler_scheduling_attempt_duration_seconds",
            "From popping the pod to its Binding being accepted (gate wait included)", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.algorithm_latency = Histogram(
            "gpupool_scheduler_scheduling_algorithm_duration_seconds",
            "Time in the placement core per decision", buckets=_ALGO_BUCKETS, registry=r)
        self.queue_length = Gauge(
            "gpupool_scheduler_pending_pods", "Pods waiting in the scheduling queue, by queue and priority",
            ["queue", "priority"], registry=r)
        self.gpus_bound = Gauge(
            "gpupool_scheduler_node_gpus_bound", "Whole GPUs held per node, by the ledger", ["node"], registry=r)
        self.memory_units_bound = Gauge(
            "gpupool_scheduler_node_gpu_memory_units_bound", "nvidia.com/gpu-memory units held per node",
            ["node"], registry=r)
        self.fragmentation = Gauge(
            "gpupool_scheduler_cluster_fragmentation_percent",
            "Idle GPU capacity the current workload profile cannot use, % of all GPU capacity (FGD)", registry=r)
        self.gpu_allocated = Gauge(
            "gpupool_scheduler_cluster_gpu_allocated_percent", "GPU capacity allocated, % (shares fractional)",
            registry=r)
        self.bind_failures = Counter(
            "gpupool_scheduler_bind_failures", "Bindings that failed, by reason", ["reason"], registry=r)
        self.bind_unknown = Counter(
            "gpupool_scheduler_bind_outcome_unknown", "Bindings whose answer was lost (timeout, 5xx, 409): the "
            "pod's devices stay taken until a read of the pod says", registry=r)
        self.bind_verified = Counter(
            "gpupool_scheduler_bind_verified", "Reads that settled an unknown Binding outcome, by what they found",
            ["outcome"], registry=r)
        self.binds_in_flight = Gauge(
            "gpupool_scheduler_binds_in_flight", "Binds sent or waiting at the handshake gate", registry=r)
        self.gate_waits = Counter(
            "gpupool_scheduler_gate_waits", "Binds that waited for an unacknowledged pod of the same shape",
            registry=r)
        self.gate_timeouts = Gauge(
            "gpupool_scheduler_gate_timeouts", "Gates opened by timeout instead of an ack (since start)", registry=r)
        self.ledger = Gauge("gpupool_scheduler_ledger_pods", "Pods in the ledger by phase", ["phase"], registry=r)
        self.nodes = Gauge("gpupool_scheduler_nodes", "Nodes known to the scheduler", registry=r)
        self.gpus = Gauge("gpupool_scheduler_gpus", "GPUs known to the scheduler, by health (the device plugin's "
                          "inventory)", ["health"], registry=r)
        self.leader = Gauge("gpupool_scheduler_leader", "1 while this instance is the leader", registry=r)
        self.events = Counter(
            "gpupool_scheduler_events_posted", "Events posted by reason and outcome", ["reason", "outcome"],
            registry=r)
        self.preemption_attempts = Counter(
            "gpupool_scheduler_preemption_attempts", "Preemption attempts of unschedulable pods by result "
            "(planned, no_plan, pdb_blocked: only pods a PodDisruptionBudget protects would do, failed: an eviction "
            "was refused)", ["result"], registry=r)
        self.preemption_victims = Counter(
            "gpupool_scheduler_preemption_victims", "Pods evicted by preemption, by reason (priority: a pod of "
            "higher priority; quota: its team's borrowed GPUs reclaimed by their GpuQuota's owner)", ["reason"],
            registry=r)
        for reason in ("priority", "quota", "idle"):
            self.preemption_victims.labels(reason=reason)
        # idle GPUs (docs/idle-and-elastic.md): the names the dashboard uses
        self.idle_pods = Gauge(
            "gpupool_scheduler_idle_pods", "Pods their device plugin lists idle for longer than their policy's "
            "idleAfter, by the policy's action (none where no policy applies)", ["action"], registry=r)
        self.idle_gpus = Gauge(
            "gpupool_scheduler_idle_gpus", "GPUs the pods of gpupool_scheduler_idle_pods hold (a memory-unit tenant "
            "counts as its fraction of the GPU), by the policy's action", ["action"], registry=r)
        for action in ("none", "report", "reclaimWhenNeeded", "reclaim"):
            self.idle_pods.labels(action=action)
            self.idle_gpus.labels(action=action)
        self.idle_reclaims = Counter(
            "gpupool_scheduler_idle_reclaims", "Idle pods reclaimed, by reason (needed: for a pending pod; policy: "
            "idle past idleAfter under action reclaim) and result (evicted, failed, blocked: by a "
            "PodDisruptionBudget or the hourly budget)", ["reason", "result"], registry=r)
        self.idle_reclaimed_gpus = Counter(
            "gpupool_scheduler_idle_reclaimed_gpus", "GPUs the evicted idle pods held, by reason", ["reason"],
            registry=r)
        for reason in ("needed", "policy"):
            self.idle_reclaimed_gpus.labels(reason=reason)
            for result in ("evicted", "failed", "blocked"):
                self.idle_reclaims.labels(reason=reason, result=result)
        # elastic inference (scheduler/elastic.py)
        self.elastic_replicas = Gauge(
            "gpupool_scheduler_elastic_replicas", "Running replicas of elastic Deployments, by tier (guaranteed: "
            "the oldest min; borrowed: the rest, given back first)", ["namespace", "deployment", "tier"],
            registry=r)
        self.elastic_scaled = Counter(
            "gpupool_scheduler_elastic_scaled", "Elastic replicas lent (up) and given back (down)", ["direction"],
            registry=r)
        self.elastic_handover = Histogram(
            "gpupool_scheduler_elastic_handover_seconds", "From a give-back decision to the waiting pod bound",
            buckets=ELASTIC_HANDOVER_BUCKETS, registry=r)
        for direction in ("up", "down"):
            self.elastic_scaled.labels(direction=direction)
        self.idle_annotation_invalid = Counter(
            "gpupool_scheduler_idle_annotation_invalid", "Malformed gpupool.io/idle-pods node annotations read "
            "(each counts as no idle pod on its node)", registry=r)
        self.migrations = Counter(
            "gpupool_scheduler_migrations", "Pods moved to defragment, by reason (blocked: for a pod that fit "
            "nowhere; background: background consolidation, to free whole GPUs) and result (planned: "
            "destination held, eviction or surge to be sent; evicted; surged: "
            "moved make-before-break, its new replica Ready; replaced: its replacement placed on the held "
            "destination; failed: the eviction or a scale was refused; rolled_back: a surge undone, its new "
            "replica not Ready in time; refused: not surged, an HPA scales its Deployment or a rollout was under "
            "way; abandoned: the pod it moved for went away first, or, in the background, a pod began waiting "
            "for GPUs)", ["reason", "result"], registry=r)
        for result in ("planned", "evicted", "surged", "replaced", "failed", "rolled_back", "refused", "abandoned"):
            for reason in ("blocked", "background"):
                self.migrations.labels(reason=reason, result=result)
        self.defrag_gpus_freed = Counter(
            "gpupool_scheduler_defrag_gpus_freed", "Whole GPUs that migrations freed, by reason (blocked: for a "
            "pod that fit nowhere; background); counted when every mover of a migration has been replaced on "
            "its held destination", ["reason"], registry=self.registry)
        for reason in ("blocked", "background"):
            self.defrag_gpus_freed.labels(reason=reason)
        self.defrag_background_allowed = Gauge(
            "gpupool_scheduler_defrag_background_allowed", "1 while background consolidation may start a move "
            "(its mode is on, this instance leads, no pod waits for GPUs, and it is in its window or idle long "
            "enough)", registry=r)
        self.migration_duration = Histogram(
            "gpupool_scheduler_migration_duration_seconds",
            "From a migration's plan to the pod it made room for being placed",
            buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600), registry=r)
        self.defrag_budget_remaining = Gauge(
            "gpupool_scheduler_defrag_budget_remaining", "Moves the defragmentation budget allows in the "
            "rest of the hour", registry=r)
        self.nominations = Gauge(
            "gpupool_scheduler_nominations", "Preemptors waiting for their victims to go (live nominations)",
            registry=r)
        self.profile_version = Gauge(
            "gpupool_scheduler_workload_profile_version", "Rebuilds of the workload profile FGD uses", registry=r)
        self.gang_wait = Histogram(
            "gpupool_scheduler_gang_wait_duration_seconds",
            "From a gang's first scheduling attempt to its minMember placed together",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.gangs = Gauge("gpupool_scheduler_pod_groups", "PodGroups by the phase the scheduler wrote",
                           ["phase"], registry=r)
        self.pending_oldest_age = Gauge(
            "gpupool_scheduler_pending_pods_oldest_age_seconds",
            "Age (since creation) of the oldest pod waiting to be scheduled or bound, by priority", ["priority"],
            registry=r)
        # Known label values start at 0 so that rate() and the alerts see the first increase.
        for result in ("scheduled", "unschedulable", "invalid", "error"):
            self.attempts.labels(result=result)
        for reason in BIND_FAILURE_REASONS:
            self.bind_failures.labels(reason=reason)
        for outcome in ("bound", "elsewhere", "unbound", "gone"):
            self.bind_verified.labels(outcome=outcome)
        for result in ("planned", "no_plan", "pdb_blocked", "failed"):
            self.preemption_attempts.labels(result=result)
        self.cluster_gpus = Gauge(
            "gpupool_scheduler_cluster_gpus", "GPUs by state, each counted once: unhealthy (the device plugin "
            "reports it failed), mig (MIG mode), whole (held by whole-GPU pods), shared (memory-unit tenants), "
            "free", ["state"], registry=r)
        self.gc_seconds = Counter(
            "gpupool_scheduler_gc_pause_seconds", "Seconds the cyclic garbage collector paused the process, by "
            "generation (2: full passes)", ["generation"], registry=r)
        for generation in ("0", "1", "2"):
            self.gc_seconds.labels(generation=generation)


def gpu_states(state: ClusterState) -> Tally[str]:
    """GPUs per `GPU_STATES` entry, each GPU once, in that order of precedence: an unhealthy GPU counts
    as unhealthy whatever it holds; a GPU with a whole-GPU pod as whole, even during a hand-over."""
    whole: set[tuple[str, int]] = set()
    shared: set[tuple[str, int]] = set()
    for entry in state.entries():
        if not entry.applied:
            continue
        for part in entry.placement.parts():
            held = whole if part.gpu_milli >= 1000 else shared
            held.update((entry.node, index) for index in part.gpu_indices)
    out: Tally[str] = Tally()
    for name, view in state.nodes.items():
        for gpu in view.spec.gpus:
            key = (name, gpu.index)
            out["unhealthy" if not gpu.healthy else "mig" if gpu.mig_enabled else "whole" if key in whole
                else "shared" if key in shared else "free"] += 1
    return out
