"""Priority preemption's decision (placement/preemption.py): victims, node choice, the preemptor's place."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.constraints import NodeConstraints, Requirement, Taint, Toleration
from gpupool_sched.model.decision import Placement, Unschedulable
from gpupool_sched.model.request import GpuShape, PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.preemption import (
    GpuCost,
    Preemption,
    RunningPod,
    gpu_cost,
    mig_slice_milli,
    pinned,
    plan_preemption,
)
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.workload import default_prior
from tests.support.clusters import BEST_FIT, HIGH, Cluster, budgeted, gpu_node, gpus, mig_node, policies

GB = 1024
def mem_share(gb: int) -> PodRequest:
    return PodRequest(name="pre", cpu_milli=500, gpu_count=1, gpu_memory_mib=gb * GB, priority=HIGH)


def uids(plan: Preemption | None) -> list[str]:
    assert plan is not None
    return [v.uid for v in plan.victims]


def chosen(plan: Preemption | None) -> str:
    assert plan is not None
    return plan.node


def assert_consistent(c: Cluster, request: PodRequest, plan: Preemption) -> None:
    """The plan's placement can be accounted once its victims are gone: nothing is overcommitted."""
    after = c.snap.copy()
    for v in plan.victims:
        after.release(v.request, v.placement)
    after.assume(request, plan.placement)
    usable = after.gpu_usable
    assert (after.free_milli[usable] >= 0).all() and (after.gpu_mem_free[usable] >= 0).all()
    assert (after.cpu_free >= 0).all() and (after.mem_free >= 0).all() and (after.pods_free >= 0).all()


# ---- whole GPUs ----------------------------------------------------------------------------------
def test_a_four_gpu_pod_evicts_exactly_four_lower_priority_pods_and_takes_their_gpus():
    c = Cluster([gpu_node(n, 8) for n in ("a", "b", "c")])
    for j in range(8):
        c.whole(f"a{j}", "a", [j], priority=HIGH, start=500 + j)  # equal priority: never a victim
        c.whole(f"b{j}", "b", [j], priority=0, start=100 + j)
        c.whole(f"c{j}", "c", [j], priority=0, start=200 + j)  # younger than b's: kube-scheduler evicts these
    request = gpus(4)
    assert not decide(c.snap.copy(), request, BEST_FIT).schedulable
    for policy in policies():
        plan = c.plan(request, policy)
        assert plan is not None and plan.node == "c" and plan.pdb_violations == 0
        assert len(plan.victims) == 4 and {v.node for v in plan.victims} == {"c"}
        # reprieve keeps the oldest (most important) pods; the victims are the youngest four
        assert sorted(uids(plan)) == ["c4", "c5", "c6", "c7"]
        assert sorted(plan.placement.gpu_indices) == sorted(g for v in plan.victims for g in v.placement.gpu_indices)
        assert plan.placement.node == "c" and plan.placement.gpu_milli == 1000
        assert_consistent(c, request, plan)
    assert c.plan(request, priority=0) is None  # nothing has a strictly lower priority than 0 here
    assert chosen(c.plan(request, priority=1)) == "c"


def test_equal_priority_pods_are_never_victims_even_when_that_leaves_no_plan():
    c = Cluster([gpu_node("a", 4), gpu_node("b", 2)])
    for j in range(4):
        c.whole(f"a{j}", "a", [j], priority=HIGH)
    c.whole("b0", "b", [0], priority=HIGH)
    c.whole("b1", "b", [1], priority=HIGH - 1)
    assert c.plan(gpus(2)) is None
    assert uids(c.plan(gpus(1))) == ["b1"]


def test_two_share_tenants_of_one_gpu_free_it_for_a_whole_gpu_pod():
    c = Cluster([gpu_node("a", 2, gpu_mem=80 * GB)])
    c.whole("job", "a", [1], priority=HIGH)
    c.share("t1", "a", 0, 20 * GB, priority=0)
    c.share("t2", "a", 0, 30 * GB, priority=1)
    plan = c.plan(gpus(1))
    assert sorted(uids(plan)) == ["t1", "t2"] and plan is not None and plan.placement.gpu_indices == (0,)
    assert uids(plan) == ["t2", "t1"]  # victims most important first


def test_cpu_and_memory_held_by_a_gpu_less_pod_are_freed_for_a_gpu_pod():
    c = Cluster([gpu_node("a", 2, cpu=8000, mem=32_000)])
    c.whole("gpu-job", "a", [0], priority=0, start=99)  # younger, but holds a GPU: reprieved first
    cpu_hog = PodRequest(name="hog", cpu_milli=6000, memory_mib=24_000, priority=0)
    c.hold("hog", cpu_hog, Placement("a"), priority=0, start=0, pdb=False)
    request = PodRequest(name="pre", cpu_milli=2000, memory_mib=8000, gpu_count=1, gpu_milli=1000, priority=HIGH)
    plan = c.plan(request)
    assert uids(plan) == ["hog"] and plan is not None and plan.placement.gpu_indices == (1,)
    cpu_only = PodRequest(name="pre", cpu_milli=4000, memory_mib=10_000, priority=HIGH)
    assert uids(c.plan(cpu_only)) == ["hog"]


# ---- GPU awareness -------------------------------------------------------------------------------
def test_a_memory_share_evicts_the_tenants_of_a_shared_gpu_not_a_whole_gpu_job():
    # same priority; the whole-GPU job started last, so plain kube-scheduler order would evict it
    for policy in policies():
        c = Cluster([gpu_node("a", 2, gpu_mem=80 * GB)])
        c.share("t1", "a", 0, 40 * GB, priority=0, start=10)
        c.share("t2", "a", 0, 40 * GB, priority=0, start=20)
        c.whole("job", "a", [1], priority=0, start=30)
        request = mem_share(50)
        plan = c.plan(request, policy)
        assert plan is not None and sorted(uids(plan)) == ["t1", "t2"]
        assert plan.placement.gpu_indices == (0,) and plan.placement.gpu_memory_mib == 50 * GB
        assert_consistent(c, request, plan)


def test_one_tenant_is_enough_when_the_rest_leaves_room():
    c = Cluster([gpu_node("a", 2, gpu_mem=80 * GB)])
    c.share("t1", "a", 0, 30 * GB, priority=0, start=10)
    c.share("t2", "a", 0, 30 * GB, priority=0, start=20)
    c.whole("job", "a", [1], priority=0, start=30)
    plan = c.plan(mem_share(40))
    assert uids(plan) == ["t2"]  # the younger tenant; the older one and the whole-GPU job stay


def test_across_nodes_the_tenants_of_one_gpu_go_before_a_whole_gpu_job():
    # kube-scheduler's priority sum and victim count alone would pick node "job" (one victim)
    c = Cluster([gpu_node("job", 1, gpu_mem=80 * GB), gpu_node("shared", 1, gpu_mem=80 * GB)])
    c.whole("w", "job", [0], priority=0, start=0)
    c.share("t1", "shared", 0, 40 * GB, priority=0, start=0)
    c.share("t2", "shared", 0, 40 * GB, priority=0, start=0)
    for request in (mem_share(50), gpus(1)):
        plan = c.plan(request)
        assert plan is not None and plan.node == "shared" and sorted(uids(plan)) == ["t1", "t2"]
    # but a higher-priority tenant is never evicted to spare GPU capacity
    c = Cluster([gpu_node("job", 1, gpu_mem=80 * GB), gpu_node("shared", 1, gpu_mem=80 * GB)])
    c.whole("w", "job", [0], priority=0)
    c.share("t1", "shared", 0, 40 * GB, priority=0)
    c.share("t2", "shared", 0, 40 * GB, priority=1)
    assert uids(c.plan(mem_share(50))) == ["w"]


def test_less_gpu_capacity_evicted_wins_over_fewer_victims():
    c = Cluster([gpu_node("two", 2, gpu_mem=80 * GB), gpu_node("one", 2, gpu_mem=80 * GB)])
    c.whole("pair", "two", [0, 1], priority=0)  # one victim, 2000 milli
    c.whole("one-a", "one", [0], priority=HIGH)
    c.share("s1", "one", 1, 20 * GB, priority=0)  # two victims, 500 milli together
    c.share("s2", "one", 1, 20 * GB, priority=0)
    assert chosen(c.plan(mem_share(60))) == "one"


def test_gpu_cost_counts_whole_gpus_shares_and_mig_slices():
    snap = ClusterSnapshot([gpu_node("a", 2, gpu_mem=80 * GB), mig_node("m")])
    a, m = snap.nodes
    assert gpu_cost(Placement("a", (0, 1), 1000, 80 * GB), a) == GpuCost(2000, 2)
    assert gpu_cost(Placement("a", (1,), 250, 20 * GB), a) == GpuCost(250, 0)
    assert gpu_cost(Placement("m", mig_devices=("MIG-m-0-a", "MIG-m-0-b")), m) == GpuCost(500 + 125, 0)
    multi = Placement("a", (0,), 1000, 80 * GB, extras=(Placement("a", (1,), 125, 10 * GB),))
    assert gpu_cost(multi, a) == GpuCost(1125, 1)
    gpu = m.gpus[0]
    assert mig_slice_milli("7g.80gb", gpu) == 1000 and mig_slice_milli("1c.3g.40gb", gpu) == 500
    assert mig_slice_milli("3g.40gb", type(gpu)(0, "A100", memory_mib=0)) == 428  # 3 of 7 compute slices
    assert mig_slice_milli("odd-profile", gpu) == 1000


# ---- PodDisruptionBudgets ------------------------------------------------------------------------
def test_a_node_without_pdb_violations_wins_over_lower_victim_priority():
    c = Cluster([gpu_node("guarded", 1), gpu_node("free", 1)])
    c.whole("g", "guarded", [0], priority=0, pdb=True)
    c.whole("f", "free", [0], priority=5)
    plan = c.plan(gpus(1))
    assert plan is not None and plan.node == "free" and uids(plan) == ["f"] and plan.pdb_violations == 0


def test_reprieve_keeps_the_pdb_blocked_pod_when_evicting_others_suffices():
    c = Cluster([gpu_node("a", 2)])
    c.whole("blocked", "a", [0], priority=0, start=50, pdb=True)
    c.whole("important", "a", [1], priority=5, start=0)  # kept before "blocked" were it not for the PDB
    plan = c.plan(gpus(1))
    assert plan is not None and uids(plan) == ["important"] and plan.pdb_violations == 0
    assert plan.placement.gpu_indices == (1,)


def test_an_unavoidable_violation_is_counted():
    c = Cluster([gpu_node("a", 2)])
    c.whole("b1", "a", [0], priority=0, pdb=True)
    c.whole("b2", "a", [1], priority=0, pdb=True)
    plan = c.plan(gpus(2))
    assert plan is not None and sorted(uids(plan)) == ["b1", "b2"] and plan.pdb_violations == 2


def test_a_budget_is_counted_down_per_victim():
    """kube-scheduler's filterPodsWithPDBViolation: a budget that allows one disruption lets one of its
    pods go; the second victim under it is a violation (the Eviction API would refuse it halfway)."""
    c = Cluster([gpu_node("a", 2), gpu_node("b", 2)])
    budgeted(c, "a0", "a", 0, 0, {"ns/one": 1})
    budgeted(c, "a1", "a", 1, 0, {"ns/one": 1})
    c.whole("b0", "b", [0], priority=5)
    c.whole("b1", "b", [1], priority=5)
    plan = c.plan(gpus(2))
    assert plan is not None and plan.node == "b" and plan.pdb_violations == 0  # not "a": 1 violation
    alone = Cluster([gpu_node("a", 2)])
    budgeted(alone, "a0", "a", 0, 0, {"ns/one": 1})
    budgeted(alone, "a1", "a", 1, 0, {"ns/one": 1})
    only = alone.plan(gpus(2))
    assert only is not None and sorted(uids(only)) == ["a0", "a1"] and only.pdb_violations == 1
    one = alone.plan(gpus(1))  # one victim: within the budget
    assert one is not None and len(one.victims) == 1 and one.pdb_violations == 0


def test_a_budget_allowing_two_lets_two_go_and_a_pod_under_two_budgets_needs_both():
    c = Cluster([gpu_node("a", 3)])
    budgeted(c, "a0", "a", 0, 0, {"ns/two": 2})
    budgeted(c, "a1", "a", 1, 0, {"ns/two": 2, "ns/none": 0})
    budgeted(c, "a2", "a", 2, 0, {"ns/two": 2})
    two = c.plan(gpus(2))
    assert two is not None and sorted(uids(two)) == ["a0", "a2"] and two.pdb_violations == 0
    three = c.plan(gpus(3))
    assert three is not None and three.pdb_violations == 2  # a1 (ns/none) and the third under ns/two


def test_budgets_already_spent_by_earlier_victims_of_the_same_plan_count():
    c = Cluster([gpu_node("a", 1)])
    budgeted(c, "a0", "a", 0, 0, {"ns/one": 1})
    fresh = c.plan(gpus(1))
    assert fresh is not None and fresh.pdb_violations == 0
    spent = plan_preemption(c.snap, gpus(1), HIGH, c.pods, BEST_FIT, np.random.default_rng(0),
                            spent={"ns/one": 1})
    assert spent is not None and spent.pdb_violations == 1


# ---- no plan -------------------------------------------------------------------------------------
def test_nothing_is_evicted_when_even_every_lower_priority_pod_gone_is_not_enough():
    c = Cluster([gpu_node("small", 2), gpu_node("mixed", 4)])
    c.whole("s0", "small", [0], priority=0)
    c.whole("s1", "small", [1], priority=0)
    for j in range(4):
        c.whole(f"m{j}", "mixed", [j], priority=0 if j < 2 else HIGH)
    assert c.plan(gpus(4)) is None  # small has 2 GPUs in all; mixed keeps 2 equal-priority pods
    assert c.plan(gpus(2, cpu=100_000)) is None  # no node has that much CPU
    assert c.plan(gpus(1), priority=0) is None
    assert plan_preemption(c.snap, gpus(1), HIGH, [], BEST_FIT) is None


def test_memory_shares_that_fit_no_gpu_even_when_emptied_get_no_plan():
    c = Cluster([gpu_node("a", 2, gpu_mem=40 * GB)])
    c.share("t", "a", 0, 30 * GB, priority=0)
    c.whole("w", "a", [1], priority=0)
    assert c.plan(mem_share(60)) is None


# ---- node constraints ----------------------------------------------------------------------------
def constrained_cluster(ok_priority: int) -> Cluster:
    """Four full one-GPU nodes: a tainted, a differently labelled and a cordoned one, each held by a pod of
    priority 0, and "ok", the one a pod selecting pool=gpu and tolerating nothing can use, held by a pod
    of ``ok_priority``."""

    def node(name: str, **changes: object) -> NodeSpec:
        spec = gpu_node(name, 1)
        return replace(spec, **{"labels": {"pool": "gpu"}, **changes})

    c = Cluster([
        node("tainted", taints=(Taint("dedicated", "infra"),)),
        node("labelled", labels={"pool": "other"}),
        node("cordoned", unschedulable=True),
        node("ok"),
    ])
    for name in ("tainted", "labelled", "cordoned"):
        c.whole(f"{name}-0", name, [0], priority=0)
    c.whole("ok-0", "ok", [0], priority=ok_priority)
    return c


def test_nodes_the_pod_cannot_use_get_no_victims():
    c = constrained_cluster(ok_priority=5)
    selector = NodeConstraints(node_selector={"pool": "gpu"})
    plan = c.plan(gpus(1, constraints=selector))
    assert plan is not None and plan.node == "ok" and uids(plan) == ["ok-0"]
    # tolerating the taint makes the tainted node eligible, and its victim is cheaper
    tolerant = NodeConstraints(node_selector={"pool": "gpu"}, tolerations=(Toleration("dedicated", "Exists"),))
    plan = c.plan(gpus(1, constraints=tolerant))
    assert plan is not None and plan.node == "tainted" and uids(plan) == ["tainted-0"]
    # required node affinity: the pod's own terms still apply on the node it is pinned to at the end
    term = (Requirement("pool", "In", ("gpu",)), Requirement("metadata.name", "NotIn", ("tainted",)))
    plan = c.plan(gpus(1, constraints=NodeConstraints(affinity_terms=(term,), tolerations=tolerant.tolerations)))
    assert plan is not None and plan.node == "ok"
    # the one usable node is held by a pod of equal priority: nothing to do, whatever the cheap victims elsewhere
    assert constrained_cluster(ok_priority=HIGH).plan(gpus(1, constraints=selector)) is None


def test_pinned_ands_the_node_into_every_affinity_term():
    term = (Requirement("pool", "In", ("gpu",)),)
    req = gpus(1, constraints=NodeConstraints(affinity_terms=(term, ())))
    pin = Requirement("metadata.name", "In", ("n1",))
    assert pinned(req, "n1").constraints == NodeConstraints(affinity_terms=((*term, pin), ()))
    assert pinned(gpus(1), "n1").constraints == NodeConstraints(affinity_terms=((pin,),))


# ---- the order of nodes --------------------------------------------------------------------------
def test_lowest_highest_victim_priority_wins_over_fewer_victims():
    c = Cluster([gpu_node("one", 2), gpu_node("two", 2)])
    c.whole("big", "one", [0, 1], priority=3)
    c.whole("x", "two", [0], priority=2)
    c.whole("y", "two", [1], priority=1)
    plan = c.plan(gpus(2))
    assert plan is not None and plan.node == "two" and uids(plan) == ["x", "y"]


def test_then_the_smaller_priority_sum():
    c = Cluster([gpu_node("r", 2), gpu_node("s", 2)])
    c.whole("r0", "r", [0], priority=2)
    c.whole("r1", "r", [1], priority=2)
    c.whole("s0", "s", [0], priority=2)
    c.whole("s1", "s", [1], priority=1)
    assert chosen(c.plan(gpus(2))) == "s"


def test_then_fewer_victims():
    # With kube-scheduler's +2^31 per victim, equal sums with different counts need a victim at the
    # lowest int32 priority: one victim of priority 0 (2^31) against 0 and -2^31 (2^31 + 0).
    c = Cluster([gpu_node("t", 2), gpu_node("u", 2)])
    c.whole("t01", "t", [0, 1], priority=0)
    c.whole("u0", "u", [0], priority=0)
    c.whole("u1", "u", [1], priority=-(2**31))
    assert chosen(c.plan(gpus(2))) == "t"


def test_then_the_latest_start_of_the_highest_priority_victims():
    c = Cluster([gpu_node("e", 2), gpu_node("f", 2)])
    c.whole("e0", "e", [0], priority=1, start=300)
    c.whole("e1", "e", [1], priority=0, start=100)
    c.whole("f0", "f", [0], priority=1, start=200)
    c.whole("f1", "f", [1], priority=0, start=900)  # the youngest pod, but not of the highest priority
    assert chosen(c.plan(gpus(2))) == "e"
    # all equal: the snapshot's tie order (node name by default)
    c = Cluster([gpu_node("h", 1), gpu_node("g", 1)])
    c.whole("h0", "h", [0], priority=0)
    c.whole("g0", "g", [0], priority=0)
    assert chosen(c.plan(gpus(1))) == "g"


def test_a_node_where_the_pod_already_fits_wins_with_no_victims():
    c = Cluster([gpu_node("full", 1), gpu_node("room", 2)])
    c.whole("f", "full", [0], priority=0)
    c.whole("r", "room", [0], priority=0)
    plan = c.plan(gpus(1))
    assert plan is not None and plan.node == "room" and plan.victims == () and plan.placement.gpu_indices == (1,)


# ---- multi-shape pods and MIG --------------------------------------------------------------------
def test_multi_shape_preemptor_and_multi_shape_victim():
    c = Cluster([gpu_node("a", 2, gpu_mem=80 * GB)])
    c.whole("w0", "a", [0], priority=0, start=1)
    c.whole("w1", "a", [1], priority=0, start=2)
    request = PodRequest.of_shapes(
        "pre", [GpuShape(gpu_count=1, gpu_milli=1000), GpuShape(gpu_count=1, gpu_memory_mib=10 * GB)], priority=HIGH
    )
    plan = c.plan(request)  # the share needs a GPU the whole GPU does not take: both go
    assert plan is not None and sorted(uids(plan)) == ["w0", "w1"]
    assert len(plan.placement.extras) == 1
    assert {plan.placement.gpu_indices[0], plan.placement.extras[0].gpu_indices[0]} == {0, 1}
    assert_consistent(c, request, plan)

    c = Cluster([gpu_node("a", 2, gpu_mem=80 * GB)])
    victim_req = PodRequest.of_shapes(
        "v", [GpuShape(gpu_count=1, gpu_milli=1000), GpuShape(gpu_count=1, gpu_memory_mib=10 * GB)], priority=0
    )
    victim_at = Placement("a", (0,), 1000, 80 * GB, extras=(Placement("a", (1,), 125, 10 * GB),))
    c.hold("v", victim_req, victim_at, priority=0, start=0, pdb=False)
    plan = c.plan(gpus(2))
    assert plan is not None and uids(plan) == ["v"] and plan.placement.gpu_indices == (0, 1)


def test_mig_slices_are_preempted_like_any_device():
    c = Cluster([mig_node("m")])
    for k, uuid in enumerate(("MIG-m-0-b", "MIG-m-0-c")):
        req = PodRequest(name=f"mig{k}", cpu_milli=100, mig_profile="1g.10gb", mig_count=1, priority=k)
        c.hold(f"mig{k}", req, Placement("m", mig_devices=(uuid,)), priority=k, start=0, pdb=False)
    request = PodRequest(name="pre", mig_profile="1g.10gb", mig_count=1, priority=HIGH)
    plan = c.plan(request)
    assert plan is not None and uids(plan) == ["mig0"] and plan.placement.mig_devices == ("MIG-m-0-b",)


# ---- against a node-by-node oracle ---------------------------------------------------------------
def oracle_victims(c: Cluster, request: PodRequest, node: str) -> tuple[list[str], int] | None:
    """kube-scheduler's SelectVictimsOnNode, one node at a time with decide() pinned to the node; the
    reprieve order is the module's (PDB-blocked first, priority, GPU held, start)."""
    snap = c.snap.copy()
    spec = snap.nodes[snap.row_of(node)]
    low = [p for p in c.pods if p.node == node and p.priority < HIGH]
    if not low:
        return None
    probe = pinned(request, node)
    for p in low:
        snap.release(p.request, p.placement)
    if isinstance(decide(snap, probe, BEST_FIT), Unschedulable):
        return None

    def importance(p: RunningPod) -> tuple[object, ...]:
        cost = gpu_cost(p.placement, spec)
        return (-p.priority, -cost.milli, -cost.whole, p.start_time, p.uid)

    def over_budget(pods: list[RunningPod]) -> set[str]:
        """Pods past their budgets' allowance, counted most important first."""
        left: dict[str, int] = {}
        out = set()
        for p in sorted(pods, key=importance):
            for name, allowed in p.budgets:
                left[name] = left.get(name, allowed) - 1
                if left[name] < 0:
                    out.add(p.uid)
            if p.pdb_blocked:
                out.add(p.uid)
        return out

    protected = over_budget(low)
    victims: list[RunningPod] = []
    for p in sorted(low, key=lambda p: (p.uid not in protected, *importance(p))):
        snap.assume(p.request, p.placement)
        if isinstance(decide(snap, probe, BEST_FIT), Unschedulable):
            snap.release(p.request, p.placement)
            victims.append(p)
    return [v.uid for v in victims], len(over_budget(victims))


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Cluster, PodRequest]:
    names = [f"n{k}" for k in range(draw(st.integers(1, 3)))]
    c = Cluster([gpu_node(n, draw(st.integers(1, 3)), cpu=16_000, gpu_mem=80 * GB) for n in names])
    for n in names:
        for j in range(len(c.snap.nodes[c.snap.row_of(n)].gpus)):
            kind = draw(st.sampled_from(["free", "whole", "tenants"]))
            prio = draw(st.sampled_from([0, 1, 5, HIGH]))
            pdb = draw(st.booleans())
            if kind == "whole":
                c.whole(f"{n}-{j}", n, [j], prio, draw(st.integers(0, 9)), pdb=pdb)
            elif kind == "tenants":
                for t in range(draw(st.integers(1, 3))):
                    gb = draw(st.sampled_from([10, 20]))
                    prio = draw(st.sampled_from([0, 1, 5, HIGH])) if t else prio
                    c.share(f"{n}-{j}-{t}", n, j, gb * GB, prio, draw(st.integers(0, 9)), pdb=pdb and t == 0)
    # PodDisruptionBudgets, counted down per victim: "one" allows 1 disruption, "two" 2, "none" 0
    shared = [(), (("one", 1),), (("two", 2),), (("one", 1), ("two", 2)), (("none", 0),)]
    c.pods = [replace(p, budgets=draw(st.sampled_from(shared))) for p in c.pods]
    requests = [gpus(1), gpus(2), gpus(1, cpu=14_000), mem_share(30), mem_share(50), mem_share(70)]
    return c, draw(st.sampled_from(requests))


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_batched_reprieve_matches_node_by_node(case: tuple[Cluster, PodRequest]):
    c, request = case
    oracle = {n: oracle_victims(c, request, n) for n in c.snap.node_names}
    plans = {n: v for n, v in oracle.items() if v is not None}
    plan = c.plan(request)
    if not plans:
        assert plan is None
        return
    assert plan is not None and plan.node in plans
    victims, violations = plans[plan.node]
    assert sorted(uids(plan)) == sorted(victims) and plan.pdb_violations == violations
    assert all(v.priority < HIGH and v.node == plan.node for v in plan.victims)
    # no node would have had fewer PDB violations, or the same and a lower highest-victim priority
    by_uid = {p.uid: p for p in c.pods}

    def head(vs: list[str], viol: int) -> tuple[int, int]:
        return (viol, max((by_uid[u].priority for u in vs), default=-(2**40)))

    assert head(victims, violations) == min(head(*v) for v in plans.values())
    assert_consistent(c, request, plan)


# ---- purity and input checks ---------------------------------------------------------------------
def _state(snap: ClusterSnapshot) -> dict[str, object]:
    arrays = {
        name: getattr(snap, name).copy()
        for name in ("cpu_free", "mem_free", "pods_free", "version", "free_milli", "gpu_mem_free", "tie_rank")
    }
    return {
        **arrays,
        "mig": {p: a.copy() for p, a in snap.mig_free.items()},
        "mig_taken": [set(s) for s in snap.mig_taken],
        "tags": [dict(t) for t in snap.gpu_tags],
        "caches": sorted(map(repr, snap.caches)),
        "generation": snap.generation,
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_the_input_snapshot_is_not_modified():
    c = Cluster([gpu_node("a", 8), gpu_node("b", 8), mig_node("m")])
    for j in range(8):
        c.whole(f"a{j}", "a", [j], priority=0)
        c.whole(f"b{j}", "b", [j], priority=j % 3)
    mig = PodRequest(name="mig", mig_profile="1g.10gb", mig_count=1)
    c.hold("mig", mig, Placement("m", mig_devices=("MIG-m-0-b",)), priority=0, start=0, pdb=False)
    decide(c.snap, gpus(8), BEST_FIT)  # fills the caches a real caller's snapshot would have
    before = _state(c.snap)
    plan = c.plan(gpus(8), build_policy("gpupool", default_prior()))
    assert plan is not None and len(plan.victims) == 8
    assert c.plan(gpus(9)) is None
    after = _state(c.snap)
    assert all(_equal(before[k], after[k]) for k in before), [k for k in before if not _equal(before[k], after[k])]


def test_running_pods_are_checked():
    c = Cluster([gpu_node("a", 1)])
    pod = c.whole("p", "a", [0], priority=0)
    with pytest.raises(ValueError, match="given twice"):
        plan_preemption(c.snap, gpus(1), HIGH, [pod, pod], BEST_FIT)
    ghost = RunningPod("g", "gone", 0, gpus(1), Placement("gone", (0,), 1000), 0.0)
    assert uids(plan_preemption(c.snap, gpus(1), HIGH, [ghost, pod], BEST_FIT)) == ["p"]
