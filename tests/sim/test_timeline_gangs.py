"""Synthetic gangs in the time simulator (`--gangs`, simulate/timegangs.py) on hand-made clusters whose answers
are worked out by hand: a gang placed whole at the departure that makes room, never in part, giving up
whole, preempting for all its members at once, a preempted member rejoining its gang, the load kept, and
determinism per seed."""

from __future__ import annotations

import functools

import pytest

from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.timegangs import GangArrival, GangSpec, GangSpecError, TimeGangs
from gpupool_sched.simulate.timeline import Decision, Timeline
from gpupool_sched.simulate.timerun import TimeSettings, run_load, workload_profile
from gpupool_sched.simulate.trace import Trace

LOW, HIGH = ("sim-best-effort", 0), ("sim-latency-sensitive", 2000)


def node(name: str, gpus: int = 4) -> NodeView:
    spec = NodeSpec(name=name, cpu_milli=64000, memory_mib=262144,
                    gpus=tuple(GpuSpec(index=i, model="A10") for i in range(gpus)))
    return NodeView(spec, None, None, None, False)


def pod(name: str, gpus: int, life: float, patience: float = 1e6, cls: tuple[str, int] = LOW) -> TimedPod:
    request = PodRequest(name=name, cpu_milli=1000, memory_mib=1024, gpu_count=gpus, gpu_milli=1000,
                         priority=cls[1])
    return TimedPod(request, life, patience, cls[0])


def timeline(*nodes: NodeView, size: int = 3) -> tuple[Timeline, TimeGangs]:
    policy = build_policy("best-fit")
    t = Timeline(list(nodes), lambda: policy, record=True)
    return t, TimeGangs(t, GangSpec(1.0, size))


def gang_at(t: Timeline, gangs: TimeGangs, at: float, name: str, member: TimedPod, size: int) -> None:
    t.call_at(at, functools.partial(gangs.arrive, GangArrival(name, member, size)))


def test_a_gang_is_placed_whole_at_the_departure_that_makes_room_never_in_part() -> None:
    t, gangs = timeline(node("n1"), node("n2"))
    gang_at(t, gangs, 10.0, "g", pod("g", 2, 30), 3)
    # a fills n1; b leaves one GPU on n2. At 50 b leaves: n2 takes two members, not three: nothing placed.
    # At 100 a leaves: n1 and n2 take two members each, so all three are placed then, together.
    stats = t.run(iter([(0.0, pod("a", 4, 100)), (0.0, pod("b", 3, 50))]), 200.0)
    members = [d for d in t.decisions if d.pod.startswith("g-")]
    assert [d.time for d in members] == [100.0, 100.0, 100.0]
    assert sorted(d.pod for d in members) == ["g-0", "g-1", "g-2"]
    assert all(len(d.gpus) == 2 for d in members)
    assert gangs.stats.placed == 1 and gangs.stats.delays == [90.0]
    assert (stats.arrivals, stats.placed, stats.gave_up) == (5, 5, 0)
    # three members waited from 10 to 100; free GPUs meanwhile: 1 until 50, then 4
    assert stats.queue_len_s == 3 * 90
    assert stats.idle_while_waiting_milli_s == 1000 * 40 + 4000 * 50
    # the gang leaves together at 130: nothing is left
    assert stats.allocated_milli_s == 4000 * 100 + 3000 * 50 + 6000 * 30
    assert t.state.pods == {} and t.queue_len == 0


def test_a_gang_that_cannot_fit_whole_places_nobody_and_gives_up_after_its_patience() -> None:
    t, gangs = timeline(node("n1"), node("n2"))
    gang_at(t, gangs, 1.0, "g", pod("g", 2, 100, patience=60), 3)
    # a holds n1 for good; at 30 b leaves n2 empty: two members would fit, the third nowhere; gone at 61
    stats = t.run(iter([(0.0, pod("a", 4, 1000)), (0.0, pod("b", 2, 30))]), 500.0)
    assert [d.pod for d in t.decisions] == ["a", "b"]
    assert gangs.stats.gave_up == 1 and gangs.stats.placed == 0
    assert stats.gave_up == 3 and t.queue_len == 0 and not gangs.queue
    assert stats.queue_len_s == 3 * 60
    assert set(e.key for e in t.state.pods.values()) == {"sim/a"}  # no member assumed or held
    assert t.state.nominations == {}


def test_a_gang_preempts_for_all_its_members_at_once() -> None:
    t, gangs = timeline(node("n1"), node("n2"))
    gang_at(t, gangs, 10.0, "h", pod("h", 4, 50, cls=HIGH), 2)
    stats = t.run(iter([(0.0, pod("l1", 4, 1000)), (0.0, pod("l2", 4, 1000))]), 2000.0)
    assert t.decisions[2] == Decision(10.0, "h", "n1,n2", (), ("l1", "l2"))
    members = t.decisions[3:5]
    assert sorted((d.time, d.node, d.gpus) for d in members) == [(10.0, "n1", (0, 1, 2, 3)), (10.0, "n2", (0, 1, 2, 3))]
    assert sorted(d.pod for d in members) == ["h-0", "h-1"]
    # the victims come back from scratch when the gang leaves at 60
    assert sorted((d.time, d.pod) for d in t.decisions[5:]) == [(60.0, "l1"), (60.0, "l2")]
    assert stats.preemptions == 2 and stats.preemptors == 1 and gangs.stats.preempting == 1
    assert gangs.stats.delays == [0.0]


def test_a_preempted_member_rejoins_its_gang_and_leaves_with_it() -> None:
    t, gangs = timeline(node("n1"))
    gang_at(t, gangs, 0.0, "g", pod("g", 2, 1000), 2)
    # h needs two GPUs: one member goes; its new pod rejoins the gang when h leaves at 150
    stats = t.run(iter([(100.0, pod("h", 2, 50, cls=HIGH))]), 2000.0)
    victim = t.decisions[2].victims
    assert t.decisions[2] == Decision(100.0, "h", "n1", (), victim) and victim in (("g-0",), ("g-1",))
    assert [(d.time, d.pod) for d in t.decisions[3:]] == [(100.0, "h"), (150.0, victim[0])]
    assert gangs.stats.members_preempted == 1 and gangs.stats.rejoined == 1 and gangs.stats.placed == 1
    # the whole gang left at 1000, the rejoined member with it
    assert stats.allocated_milli_s == 4000 * 100 + 4000 * 50 + 4000 * 850
    assert t.state.pods == {}


def test_the_load_factor_keeps_the_offered_load() -> None:
    pods = [pod("one", 1, 100), pod("two", 2, 100)]  # 100 and 200 GPU-seconds
    # half of the two-GPU arrivals become 4 pods: 200 x 0.5 x 3 more on average
    assert GangSpec(0.5, 4).load_factor(pods) == pytest.approx((300 + 300) / 300)
    assert GangSpec(1.0, 4).load_factor([pod("one", 1, 100)]) == 1.0


@pytest.mark.parametrize(("text", "message"), [
    ("0.5", "expected SHARE:SIZE"), ("x:4", "SHARE 'x' is not a number"), ("0:4", "SHARE must be in (0, 1]"),
    ("1.5:4", "SHARE must be in (0, 1]"), ("0.5:1", "SIZE must be in 2..64"), ("0.5:four", "is not an integer"),
])
def test_bad_gang_specs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(GangSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GangSpec.parse(text)


def tiny_trace() -> tuple[Trace, list[TimedPod]]:
    specs = tuple(NodeSpec(name=f"n{i:02d}", cpu_milli=96000, memory_mib=524288,
                           gpus=tuple(GpuSpec(index=j, model="A10") for j in range(8))) for i in range(12))
    pods = [pod(f"p{i}", (1, 2, 4, 1)[i % 4], (600.0, 3600.0, 1800.0)[i % 3], patience=900.0, cls=(LOW, HIGH)[i % 2])
            for i in range(24)]
    return Trace("tiny", specs, tuple(p.request for p in pods)), pods


def test_runs_with_gangs_are_deterministic_per_seed() -> None:
    tr, pods = tiny_trace()
    profile = workload_profile(tr)

    def once(seed: int) -> dict[str, object]:
        settings = TimeSettings(duration_s=4 * 3600, horizon_s=3600, seed=seed, policy="gpupool",
                                gangs=GangSpec(0.5, 3))
        out = run_load(tr, pods, profile, settings, 1.0).json()
        out.pop("seconds")
        out.pop("placement_seconds")
        return out

    first = once(7)
    assert first == once(7)
    assert first != once(8)
    gangs = first["gangs"]
    assert isinstance(gangs, dict) and gangs["arrived"] > 0 and gangs["placed"] > 0



@pytest.mark.parametrize("ganged", [True, False])
def test_the_consolidate_action_never_moves_a_gang_member(ganged: bool) -> None:
    # f3 fills n1; the fillers leave two GPUs free on n2 and on n3 at 1, where the pair goes, one each, and
    # leave at 10: h (4 GPUs) then fits only if one of the pair moves to the other's node
    policy = build_policy("best-fit")
    t = Timeline([node("n1"), node("n2"), node("n3")], lambda: policy, record=True,
                 defrag=DefragConfig(after_s=0.0, min_runtime_s=0.0))
    gangs = TimeGangs(t, GangSpec(1.0, 2))
    fillers = [(0.0, pod("f3", 4, 5000)), (0.0, pod("f1", 2, 10)), (0.0, pod("fb", 2, 0.5)), (0.0, pod("f2", 2, 10))]
    if ganged:
        gang_at(t, gangs, 1.0, "g", pod("g", 2, 3000), 2)
        arrivals = [*fillers, (100.0, pod("h", 4, 100))]
    else:  # the same pods, lone: one of them moves for h
        arrivals = [*fillers, (1.0, pod("g-0", 2, 3000)), (1.0, pod("g-1", 2, 3000)), (100.0, pod("h", 4, 100))]
    stats = t.run(iter(arrivals), 4000.0)
    h = [d for d in t.decisions if d.pod == "h" and not d.moved]
    assert sorted(d.node for d in t.decisions if d.pod.startswith("g-") and d.time == 1.0) == ["n2", "n3"]
    if ganged:
        assert stats.migrations == 0 and [d.time for d in h] == [3001.0]  # it waits for the gang to leave
    else:
        assert stats.migrations == 1 and [d.time for d in h] == [100.0]
