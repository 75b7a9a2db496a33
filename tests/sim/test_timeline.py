"""The simulator in time (`gpupool simulate --mode time`) on hand-made clusters whose answers are worked out
by hand: a departure places the waiting pod at that instant, patience runs out, a preemption and its
requeue, the time integrals, the Poisson pacing and the pre-fill, determinism per seed."""

from __future__ import annotations

import numpy as np
import pytest

from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.pacing import arrival_rate, poisson_arrivals, prefill
from gpupool_sched.simulate.timeline import Decision, Timeline
from gpupool_sched.simulate.timerun import TimeSettings, run_load
from gpupool_sched.simulate.trace import Trace

LOW, HIGH = ("sim-best-effort", 0), ("sim-latency-sensitive", 2000)


def node(name: str, gpus: int) -> NodeView:
    spec = NodeSpec(name=name, cpu_milli=64000, memory_mib=262144,
                    gpus=tuple(GpuSpec(index=i, model="A10") for i in range(gpus)))
    return NodeView(spec, None, None, None, False)


def pod(name: str, gpus: int, life: float, patience: float = 1e6, cls: tuple[str, int] = LOW,
        milli: int = 1000) -> TimedPod:
    request = PodRequest(name=name, cpu_milli=1000, memory_mib=1024, gpu_count=gpus, gpu_milli=milli,
                         priority=cls[1])
    return TimedPod(request, life, patience, cls[0])


def timeline(*nodes: NodeView) -> Timeline:
    policy = build_policy("best-fit")
    return Timeline(list(nodes), lambda: policy, record=True)


def test_a_departure_places_the_waiting_pod_at_that_instant() -> None:
    t = timeline(node("n1", 3))
    stats = t.run(iter([(0.0, pod("a", 2, 100)), (10.0, pod("b", 2, 50))]), 200.0)
    assert t.decisions == [Decision(0.0, "a", "n1", (0, 1)), Decision(100.0, "b", "n1", (0, 1))]
    assert sorted(stats.delays[LOW[0]]) == [0.0, 90.0]
    # a: 2000 milli x 100 s, b: 2000 milli x 50 s, over 3000 milli x 200 s
    assert stats.allocated_milli_s == 2000 * 100 + 2000 * 50
    # b waited from 10 to 100 with one GPU free: 90 GPU-seconds unallocated while a pod waited
    assert stats.idle_while_waiting_milli_s == 1000 * 90
    assert stats.waiting_s == 90
    assert (stats.arrivals, stats.placed, stats.gave_up, stats.preemptions) == (2, 2, 0, 0)


def test_a_pod_gives_up_after_its_patience() -> None:
    t = timeline(node("n1", 3))
    stats = t.run(iter([(0.0, pod("a", 2, 100)), (10.0, pod("b", 2, 50, patience=30))]), 200.0)
    assert t.decisions == [Decision(0.0, "a", "n1", (0, 1))]  # b never placed: gone at 40, a leaves at 100
    assert stats.gave_up == 1
    assert stats.waiting_s == 30
    assert stats.idle_while_waiting_milli_s == 1000 * 30


def test_preemption_evicts_the_lower_priority_pod_and_requeues_it_from_scratch() -> None:
    t = timeline(node("n1", 2))
    stats = t.run(iter([(0.0, pod("low", 2, 1000)), (10.0, pod("high", 1, 100, cls=HIGH))]), 5000.0)
    assert t.decisions == [
        Decision(0.0, "low", "n1", (0, 1)),
        Decision(10.0, "high", "n1", (), victims=("low",)),
        Decision(10.0, "high", "n1", (0,)),
        Decision(110.0, "low", "n1", (0, 1)),  # back when high leaves, for its whole lifetime again
    ]
    assert stats.preemptions == 1 and stats.preemptors == 1
    assert sorted(stats.delays[LOW[0]]) == [0.0, 100.0]
    assert stats.delays[HIGH[0]] == [0.0]
    # low ran 0..10 and 110..1110, high 10..110
    assert stats.allocated_milli_s == 2000 * 10 + 1000 * 100 + 2000 * 1000
    assert t.state.pods == {}  # everything left; no hold, nomination or entry lingers
    assert t.state.nominations == {}


def test_an_equal_priority_pod_waits_instead_of_preempting() -> None:
    t = timeline(node("n1", 2))
    stats = t.run(iter([(0.0, pod("first", 2, 100)), (10.0, pod("second", 1, 100))]), 300.0)
    assert stats.preemptions == 0
    assert t.decisions[-1] == Decision(100.0, "second", "n1", (0,))


def test_waiting_pods_go_by_priority_then_arrival() -> None:
    t = timeline(node("n1", 1))
    arrivals = [(0.0, pod("a", 1, 100)), (1.0, pod("b", 1, 10)), (2.0, pod("c", 1, 10)),
                (3.0, pod("d", 1, 10, cls=("sim-burstable", 1000)))]
    t.run(iter(arrivals), 1000.0)
    # d preempts a at once (a is requeued last); then b, c in arrival order; a last
    placed = [(d.time, d.pod) for d in t.decisions if not d.victims]
    assert placed == [(0.0, "a"), (3.0, "d"), (13.0, "b"), (23.0, "c"), (33.0, "a")]


def test_a_share_pod_fits_beside_another_share_on_one_gpu() -> None:
    t = timeline(node("n1", 1))
    stats = t.run(iter([(0.0, pod("s1", 1, 100, milli=500)), (1.0, pod("s2", 1, 100, milli=500)),
                        (2.0, pod("s3", 1, 10, milli=500))]), 500.0)
    assert [(d.time, d.pod) for d in t.decisions] == [(0.0, "s1"), (1.0, "s2"), (100.0, "s3")]
    assert stats.allocated_milli_s == 500 * 100 + 500 * 100 + 500 * 10


def trace(gpus_per_node: int = 8, nodes: int = 20) -> tuple[Trace, list[TimedPod]]:
    specs = tuple(NodeSpec(name=f"n{i:02d}", cpu_milli=96000, memory_mib=524288,
                           gpus=tuple(GpuSpec(index=j, model="A10") for j in range(gpus_per_node)))
                  for i in range(nodes))
    pods = [pod(f"p{i}", (1, 2, 4, 1)[i % 4], (600.0, 3600.0, 1800.0, 7200.0)[i % 3],
                patience=900.0, cls=(LOW, HIGH)[i % 2], milli=(1000, 1000, 1000, 500)[i % 4]) for i in range(24)]
    return Trace("tiny", specs, tuple(p.request for p in pods)), pods


def test_runs_are_deterministic_per_seed() -> None:
    tr, pods = trace()
    from gpupool_sched.simulate.timerun import workload_profile

    profile = workload_profile(tr)

    def once(seed: int) -> dict[str, object]:
        out = run_load(tr, pods, profile, TimeSettings(duration_s=6 * 3600, horizon_s=7200, seed=seed,
                                                       policy="gpupool"), 1.1).json()
        out.pop("seconds")
        out.pop("placement_seconds")
        return out

    first = once(7)
    assert first == once(7)
    assert first != once(8)
    assert first["preemptions"] > 0 and first["gave_up"] > 0  # the run exercised the queue and preemption


def test_poisson_pacing_offers_the_asked_load() -> None:
    _, pods = trace()
    capacity = 160
    rate = arrival_rate(pods, capacity, 0.9)
    rng = np.random.default_rng(3)
    span = 400 * 86400.0
    arrivals = poisson_arrivals(pods, rate, rng, 0, span)
    offered = sum(p.request.gpu_milli_total / 1000 * p.lifetime_s for _, p in arrivals)
    assert offered / (capacity * span) == pytest.approx(0.9, rel=0.01)


def test_prefill_starts_the_run_in_steady_state() -> None:
    # a cluster far larger than the load: nothing waits, so allocation is the offered load from the start
    tr, pods = trace(nodes=40)
    policy = build_policy("best-fit")
    rate = arrival_rate(pods, tr.total_gpus, 0.5)
    rng = np.random.default_rng(11)
    t = Timeline([NodeView(s, None, None, None, False) for s in tr.nodes], lambda: policy)
    running = prefill(pods, rate, 7200.0, rng)
    t.prefill(running)
    assert t.stats.prefill_dropped == 0
    at_start = t.allocated_milli / t.stats.capacity_milli
    stats = t.run(poisson_arrivals(pods, rate, rng, 0.0, 2 * 3600.0), 2 * 3600.0)
    mean = stats.allocated_milli_s / (stats.capacity_milli * 2 * 3600.0)
    assert at_start == pytest.approx(0.5, abs=0.1)  # without the pre-fill it is 0
    assert mean == pytest.approx(0.5, abs=0.08)
    assert stats.gave_up == 0 and stats.preemptions == 0
