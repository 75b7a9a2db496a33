"""Migrations in the time simulator (`--defrag on`, simulate/timemoves.py): a pod that fits only after a
move is placed once it has waited --defrag-after, with the mover and destination worked out by hand, and
the mover's replacement runs on the reserved destination for the rest of the mover's lifetime; with
defrag off it waits. The hourly budget holds with many blocked pods; runs are deterministic per seed."""

from __future__ import annotations

from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.timeline import Decision, Timeline
from gpupool_sched.simulate.timerun import TimeSettings, run_load, workload_profile
from gpupool_sched.simulate.trace import Trace

LOW = ("sim-best-effort", 0)


def node(name: str, gpus: int) -> NodeView:
    spec = NodeSpec(name=name, cpu_milli=64000, memory_mib=262144,
                    gpus=tuple(GpuSpec(index=i, model="A10", memory_mib=24576) for i in range(gpus)))
    return NodeView(spec, None, None, None, False)


def pod(name: str, gpus: int, life: float, patience: float = 1e6) -> TimedPod:
    request = PodRequest(name=name, cpu_milli=1000, memory_mib=1024, gpu_count=gpus, gpu_milli=1000, priority=0)
    return TimedPod(request, life, patience, LOW[0])


def timeline(defrag: DefragConfig | None, *nodes: NodeView) -> Timeline:
    policy = build_policy("best-fit")
    return Timeline(list(nodes), lambda: policy, record=True, defrag=defrag)


# two 4-GPU nodes: a and c leave at 1000 and 1002, so each node keeps one 1-GPU pod (b, d) and 3 free GPUs;
# h asks 4 GPUs at 2000: it fits only once b or d moves beside the other
FRAGMENTED = [(0.0, pod("a", 3, 1000)), (1.0, pod("b", 1, 5000)), (2.0, pod("c", 3, 1000)),
              (3.0, pod("d", 1, 5000)), (2000.0, pod("h", 4, 300))]
FILLED = [Decision(0.0, "a", "n1", (0, 1, 2)), Decision(1.0, "b", "n1", (3,)), Decision(2.0, "c", "n2", (0, 1, 2)),
          Decision(3.0, "d", "n2", (3,))]


def test_a_pod_that_fits_only_after_a_move_is_placed_once_it_waited_defrag_after() -> None:
    t = timeline(DefragConfig(), node("n1", 4), node("n2", 4))  # the scheduler's defaults: after 60 s
    stats = t.run(iter(FRAGMENTED), 3000.0)
    # at 2000 a move would place h: it waits --defrag-after (nothing moves, nothing is preempted), then b
    # moves to n2's free GPU 0, h takes all of n1, and b's replacement lands on the room held on n2
    assert t.decisions == [*FILLED,
                           Decision(2060.0, "h", "n1", (), moved=(("b", "n2", (0,)),)),
                           Decision(2060.0, "h", "n1", (0, 1, 2, 3)),
                           Decision(2060.0, "b", "n2", (0,))]
    assert (stats.migrations, stats.migrated_for, stats.misplaced, stats.preemptions) == (1, 1, 0, 0)
    assert stats.placed == 5 and stats.delays[LOW[0]][-1] == 60.0  # the replacement is not placed twice
    assert not t.state.reservations and not t.state.nominations
    replacement = [e for e in t.state.pods.values() if e.key == "sim/b"]
    assert [(e.node, e.placement.gpu_indices) for e in replacement] == [("n2", (0,))]
    # the replacement runs what b had left (b started at 1, lives 5000 s: it leaves at 5001)
    t.run(iter([]), 5000.5)
    assert [e.key for e in t.state.pods.values() if e.node == "n2"] == ["sim/d", "sim/b"]
    t.run(iter([]), 5001.5)
    assert sorted(e.key for e in t.state.pods.values()) == ["sim/d"]
    # b ran 1..5001 once in all (1 GPU), h 2060..2360 (4 GPUs), a and c 1000 s (3 GPUs), d 3..5001.5
    assert t.stats.allocated_milli_s == 1000 * 5000 + 4000 * 300 + 2 * 3000 * 1000 + 1000 * 4998.5


def test_with_defrag_off_the_pod_waits_for_a_departure() -> None:
    t = timeline(DefragConfig(enabled=False), node("n1", 4), node("n2", 4))
    stats = t.run(iter(FRAGMENTED), 6000.0)
    assert t.decisions == [*FILLED, Decision(5001.0, "h", "n1", (0, 1, 2, 3))]
    assert stats.migrations == 0
    gave_up = timeline(DefragConfig(enabled=False), node("n1", 4), node("n2", 4))
    stats = gave_up.run(iter([*FRAGMENTED[:4], (2000.0, pod("h", 4, 300, patience=600))]), 6000.0)
    assert (stats.gave_up, stats.migrations) == (1, 0)


def blocked_cluster(budget: int | None) -> tuple[Timeline, list[tuple[float, TimedPod]]]:
    """Twenty 2-GPU nodes each half used by a long 1-GPU pod (best-fit packs two per node; every second one
    leaves at once), then ten 2-GPU pods that each fit only after one move (nothing else ever leaves). The
    GPUs' memory is known, so that the consolidation ranks moving one 1-GPU pod before moving a 2-GPU one
    (with unknown memory it tries 8 nodes in tie-break order, placement/consolidation.py)."""
    fill = [(float(i), pod(f"f{i:02d}", 1, 500.0 if i % 2 else 1e6)) for i in range(40)]
    blocked = [(1000.0 + i, pod(f"h{i}", 2, 1e6)) for i in range(10)]
    return timeline(DefragConfig(per_hour=budget), *(node(f"n{i:02d}", 2) for i in range(20))), [*fill, *blocked]


def test_the_hourly_budget_holds_with_many_blocked_pods() -> None:
    for budget, expected in ((None, 5), (3, 10)):  # None: 1 % of 20-30 running GPU pods, at least 1
        t, arrivals = blocked_cluster(budget)
        stats = t.run(iter(arrivals), 1000.0 + 4.5 * 3600)
        moves = sorted(d.time for d in t.decisions if d.moved)
        allowed = 1 if budget is None else budget
        assert all(sum(1 for m in moves if at <= m < at + 3600.0) <= allowed for at in moves)
        # the budget is what holds them: each blocked pod moves a pod as soon as the budget frees
        assert len(moves) == expected and stats.migrations == expected
        assert moves[0] == 1060.0
        if budget is None:
            assert moves == [1060.0 + k * 3600.0 for k in range(5)]


def small_trace() -> tuple[Trace, list[TimedPod]]:
    specs = tuple(NodeSpec(name=f"n{i:02d}", cpu_milli=96000, memory_mib=524288,
                           gpus=tuple(GpuSpec(index=j, model="A10") for j in range(4))) for i in range(12))
    pods = [pod(f"p{i}", (1, 2, 4, 1, 3)[i % 5], (1800.0, 3600.0, 7200.0)[i % 3], patience=3600.0)
            for i in range(30)]
    return Trace("tiny", specs, tuple(p.request for p in pods)), pods


def test_runs_with_migrations_are_deterministic_per_seed() -> None:
    tr, pods = small_trace()
    profile = workload_profile(tr)

    def once(seed: int, defrag: DefragConfig) -> dict[str, object]:
        out = run_load(tr, pods, profile, TimeSettings(duration_s=8 * 3600, horizon_s=7200, seed=seed,
                                                       policy="gpupool", defrag=defrag), 1.2).json()
        out.pop("seconds")
        out.pop("placement_seconds")
        return out

    first = once(7, DefragConfig(per_hour=20))
    assert first == once(7, DefragConfig(per_hour=20))
    assert first["migrations"] > 0 and first["moved_pct_of_arrivals"] > 0
    assert first != once(8, DefragConfig(per_hour=20))
    off = once(7, DefragConfig(enabled=False))
    assert off["migrations"] == 0 and off["defrag"] == "off"
