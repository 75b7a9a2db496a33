"""Preemption's candidate sampling (placement/candidates.py): kube-scheduler's count, and the search that
stops once that many viable nodes are found, exactly the full search when there are no more than that."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement import preemption
from gpupool_sched.placement.candidates import FULL_SEARCH, CandidateBudget, start_offset
from gpupool_sched.placement.gang_preemption import plan_gang_preemption
from gpupool_sched.placement.preemption import Preemption, fit_mask, plan_preemption
from tests.support.clusters import BEST_FIT, HIGH, Cluster, gpu_node, gpus, policies

GB = 1024


def test_count_is_kube_schedulers_calculate_num_candidates():
    default = CandidateBudget()
    assert [default.count(n) for n in (0, 1, 50, 100, 999, 1000, 1500, 5000)] == [0, 1, 50, 100, 100, 100, 150, 500]
    assert CandidateBudget(min_percentage=50, min_absolute=10).count(30) == 15
    assert CandidateBudget(min_percentage=1, min_absolute=0).count(50) == 1  # never 0 of a non-empty set
    assert FULL_SEARCH.count(10**6) == 10**6


@pytest.mark.parametrize("bad", [dict(min_percentage=101), dict(min_percentage=-1), dict(min_absolute=-1),
                                 dict(min_percentage=0, min_absolute=0), dict(seconds=0.0)])
def test_budget_is_checked(bad: dict[str, float]):
    with pytest.raises(ValueError):
        CandidateBudget(**bad)  # type: ignore[arg-type]


def test_start_offset_is_stable_and_leaves_the_callers_stream_alone():
    assert start_offset("pod-a", 1000, None) == start_offset("pod-a", 1000, None)
    assert len({start_offset(f"pod-{k}", 1000, None) for k in range(50)}) > 40
    rng = np.random.default_rng(7)
    state = rng.bit_generator.state
    first = start_offset("pod-a", 1000, rng)
    assert rng.bit_generator.state == state and start_offset("pod-a", 1000, rng) == first
    assert start_offset("x", 0, rng) == 0


# ---- below and at the threshold: the full search's answer ----------------------------------------------
def random_case(seed: int) -> tuple[Cluster, PodRequest]:
    """5-40 nodes of 2-4 GPUs: free GPUs, whole-GPU pods and memory-share tenants of random priorities,
    start times and PodDisruptionBudgets; a whole-GPU or memory-share preemptor. On a third of the nodes
    a HIGH tenant holds 40 GB of every GPU: a large share passes the cheap bound there but is not viable."""
    r = np.random.default_rng(seed)
    names = [f"n{k:02d}" for k in range(int(r.integers(5, 41)))]
    c = Cluster([gpu_node(n, int(r.integers(2, 5)), cpu=16_000, gpu_mem=80 * GB) for n in names])
    prios = [0, 1, 5, HIGH]
    for n in names:
        guarded = r.random() < 0.35
        for j in range(len(c.snap.nodes[c.snap.row_of(n)].gpus)):
            kind = "tenants" if guarded else r.choice(["free", "whole", "whole", "tenants"])
            if guarded:
                c.share(f"{n}-{j}-h", n, j, 40 * GB, HIGH, float(r.integers(10)))
            if kind == "whole":
                c.whole(f"{n}-{j}", n, [j], int(r.choice(prios)), float(r.integers(10)), pdb=bool(r.random() < 0.1))
            elif kind == "tenants":
                for t in range(int(r.integers(0 if guarded else 1, 3 if guarded else 4))):  # at most 80 GB
                    c.share(f"{n}-{j}-{t}", n, j, int(r.choice([10, 20])) * GB, int(r.choice(prios)),
                            float(r.integers(10)))
    shared = [(), (), (("one", 1),), (("two", 2),), (("one", 1), ("two", 2))]
    c.pods = [replace(p, budgets=shared[int(r.integers(len(shared)))]) for p in c.pods]
    share = PodRequest(name=f"pre-{seed}", cpu_milli=500, gpu_count=1, gpu_memory_mib=int(r.choice([30, 50, 70])) * GB,
                       priority=HIGH)
    whole = replace(gpus(int(r.integers(1, 3))), name=f"pre-{seed}")
    return c, share if r.random() < 0.5 else whole


def viable(snap: ClusterSnapshot, pods: list, request: PodRequest) -> set[str]:  # type: ignore[type-arg]
    """Nodes with lower-priority pods where the pod fits once all of them are gone."""
    work = snap.copy()
    low = [p for p in pods if p.priority < HIGH]
    for p in low:
        work.release(p.request, p.placement)
    fits = fit_mask(work, request, BEST_FIT)
    return {p.node for p in low if fits[snap.row_of(p.node)]}


@pytest.mark.parametrize("min_chunk", [1, preemption._MIN_CHUNK])
@pytest.mark.parametrize("seed", range(45))
def test_no_more_viable_nodes_than_the_count_gives_the_full_searchs_answer(
    seed: int, min_chunk: int, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(preemption, "_MIN_CHUNK", min_chunk)  # 1: the search stops on the last one found
    c, request = random_case(seed)
    n_viable = len(viable(c.snap, c.pods, request))
    policy = policies()[seed % 3]

    def plan(budget: CandidateBudget | None, rng_seed: int = 0) -> Preemption | None:
        return plan_preemption(c.snap, request, HIGH, c.pods, policy, np.random.default_rng(rng_seed), budget=budget)

    full = plan(FULL_SEARCH)
    assert (full is None) == (n_viable == 0)
    assert plan(None) == full  # these clusters have fewer than 100 potential nodes: no sampling at all
    for k in (n_viable, n_viable + 1, n_viable + 3):  # at the threshold, then below it
        for rng_seed in (0, 1, 2):  # different start offsets
            sampled = plan(CandidateBudget(min_percentage=0, min_absolute=max(k, 1)), rng_seed)
            assert sampled == full, (k, rng_seed)


def test_those_cases_include_searches_that_stop_before_the_last_potential_node(monkeypatch: pytest.MonkeyPatch):
    """The property above is not vacuous: at the threshold, sampled searches do skip nodes."""
    monkeypatch.setattr(preemption, "_MIN_CHUNK", 1)
    early = 0
    for seed in range(45):
        c, request = random_case(seed)
        n_viable = len(viable(c.snap, c.pods, request))
        full = plan_preemption(c.snap, request, HIGH, c.pods, BEST_FIT, budget=FULL_SEARCH)
        if full is None:
            continue
        for rng_seed in range(3):
            sampled = plan_preemption(c.snap, request, HIGH, c.pods, BEST_FIT, np.random.default_rng(rng_seed),
                                      budget=CandidateBudget(min_percentage=0, min_absolute=n_viable))
            assert sampled == full
            early += sampled.considered < full.considered  # type: ignore[union-attr]
    assert early >= 5


@pytest.mark.parametrize("seed", range(15))
def test_above_the_threshold_the_answer_is_a_valid_plan_among_the_viable_nodes(seed: int):
    c, request = random_case(100 + seed)
    nodes = viable(c.snap, c.pods, request)
    assert len(nodes) >= 2, "the seeded case must offer a choice: at least 2 viable nodes"
    plan = plan_preemption(c.snap, request, HIGH, c.pods, BEST_FIT, np.random.default_rng(seed),
                           budget=CandidateBudget(min_percentage=0, min_absolute=1))
    assert plan is not None and plan.node in nodes
    assert_valid(c, request, plan)


def assert_valid(c: Cluster, request: PodRequest, plan: Preemption) -> None:
    """Only lower-priority pods of the chosen node go, and the pod then fits where the plan puts it."""
    assert all(v.priority < HIGH and v.node == plan.node for v in plan.victims)
    after = c.snap.copy()
    for v in plan.victims:
        after.release(v.request, v.placement)
    assert fit_mask(after, request, BEST_FIT)[after.row_of(plan.node)]
    after.assume(request, plan.placement)
    assert (after.free_milli[after.gpu_usable] >= 0).all() and (after.cpu_free >= 0).all()


# ---- at scale: the search stops once it has its candidates ---------------------------------------------
def busy_cluster(nodes: int) -> Cluster:
    """``nodes`` nodes of 8 GPUs, each GPU held by a lower-priority whole-GPU pod: every node is viable."""
    c = Cluster([gpu_node(f"n{k:04d}", 8) for k in range(nodes)])
    for k in range(nodes):
        for j in range(8):
            c.whole(f"n{k:04d}-{j}", f"n{k:04d}", [j], priority=j % 3, start=float(j))
    return c


def test_a_large_cluster_releases_pods_on_about_the_candidate_count_only(monkeypatch: pytest.MonkeyPatch):
    c = busy_cluster(600)
    released: set[str] = set()
    real = ClusterSnapshot.release

    def counting(self: ClusterSnapshot, request: PodRequest, placement: object) -> None:
        released.add(placement.node)  # type: ignore[attr-defined]
        real(self, request, placement)  # type: ignore[arg-type]

    monkeypatch.setattr(ClusterSnapshot, "release", counting)
    plan = plan_preemption(c.snap, gpus(2), HIGH, c.pods, BEST_FIT, np.random.default_rng(0))  # default budget
    monkeypatch.setattr(ClusterSnapshot, "release", real)
    want, chunk = CandidateBudget().count(600), 16
    assert len(released) <= want + chunk, f"pods released on {len(released)} of 600 nodes"
    assert plan is not None and plan.considered <= want + chunk
    assert len(released) == plan.considered
    assert [v.priority for v in plan.victims] == [0, 0]  # two of the node's priority-0 pods, as on any node
    assert_valid(c, gpus(2), plan)


def test_a_gang_sums_its_members_searches():
    c = busy_cluster(300)
    members = [replace(gpus(4), name=f"m{k}") for k in range(3)]
    plan = plan_gang_preemption(c.snap, members, 3, HIGH, c.pods, BEST_FIT, np.random.default_rng(0),
                                budget=CandidateBudget(min_percentage=0, min_absolute=20))
    assert plan is not None and len(plan.members) == 3
    assert 3 * 20 <= plan.considered <= 3 * (20 + 16)


def test_a_time_budget_stops_after_a_chunk_with_a_viable_node():
    # 300 potential nodes, one in ten viable: elsewhere a HIGH tenant holds 20 GB of each 80 GB GPU
    c = Cluster([gpu_node(f"n{k:03d}", 2, gpu_mem=80 * GB) for k in range(300)])
    for k in range(300):
        for j in range(2):
            if k % 10:
                c.share(f"h{k}-{j}", f"n{k:03d}", j, 20 * GB, HIGH)
            c.share(f"l{k}-{j}", f"n{k:03d}", j, 20 * GB, 0)
    request = PodRequest(name="pre", cpu_milli=500, gpu_count=1, gpu_memory_mib=70 * GB, priority=HIGH)
    untimed = plan_preemption(c.snap, request, HIGH, c.pods, BEST_FIT)
    assert untimed is not None and untimed.considered == 300  # 30 viable < 100 wanted: every node
    timed = plan_preemption(c.snap, request, HIGH, c.pods, BEST_FIT, budget=CandidateBudget(seconds=1e-9))
    assert timed is not None and timed.considered == 100  # the first chunk found some, then time was up
    assert int(timed.node[1:]) % 10 == 0 and [v.uid[0] for v in timed.victims] == ["l"]
