"""The scheduler's Prometheus metrics (names follow kube-scheduler's where one exists)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ALGO_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


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
            "(planned, no_plan, failed: an eviction was refused)", ["result"], registry=r)
        self.preemption_victims = Counter(
            "gpupool_scheduler_preemption_victims", "Pods evicted by preemption", registry=r)
        self.nominations = Gauge(
            "gpupool_scheduler_nominations", "Preemptors waiting for their victims to go (live nominations)",
            registry=r)
        self.profile_version = Gauge(
            "gpupool_scheduler_workload_profile_version", "Rebuilds of the workload profile FGD uses", registry=r)
