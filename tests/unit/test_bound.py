"""The lower bound (simulate/bound.py) against brute force on tiny clusters: never above the true minimum of
unallocated GPU milli, equal to it where the LP is integral, tighter with the configuration LP where CPU binds."""

from __future__ import annotations

import random

import pytest

from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.simulate.bound import config_lp, lower_bound, pattern_lp
from gpupool_sched.simulate.bound_instance import instance, measured_prefix


def node(name: str, gpus: int, model: str = "T4", cpu: int = 32000, mem: int = 65536) -> NodeSpec:
    return NodeSpec(name, cpu, mem, tuple(GpuSpec(i, model) for i in range(gpus)))


def pod(name: str, gpus: int, milli: int, cpu: int = 1000, mem: int = 1024, models: str = "") -> PodRequest:
    return PodRequest(name=name, cpu_milli=cpu, memory_mib=mem, gpu_count=gpus, gpu_milli=milli,
                      gpu_models=frozenset(m for m in models.split("|") if m))


def brute_max_allocated(nodes: list[NodeSpec], pods: list[PodRequest]) -> int:
    """The most GPU milli any subset of ``pods`` placed at once holds: every pod tried unplaced and on every
    node and GPU choice (exhaustive depth-first search over feasible partial placements)."""
    cpu = [n.cpu_milli for n in nodes]
    mem = [n.memory_mib for n in nodes]
    free = [[MILLI] * len(n.gpus) for n in nodes]  # milli left per GPU
    best = 0

    def go(i: int, held: int) -> None:
        nonlocal best
        if held + sum(p.gpu_milli_total for p in pods[i:]) <= best:
            return
        if i == len(pods):
            best = max(best, held)
            return
        p = pods[i]
        for j, n in enumerate(nodes):
            if p.cpu_milli > cpu[j] or p.memory_mib > mem[j]:
                continue
            ok = [g for g, spec in enumerate(n.gpus) if not p.gpu_models or spec.model in p.gpu_models]
            cpu[j] -= p.cpu_milli
            mem[j] -= p.memory_mib
            if p.gpu_milli < MILLI:  # a share: any GPU with room
                for g in ok:
                    if free[j][g] >= p.gpu_milli:
                        free[j][g] -= p.gpu_milli
                        go(i + 1, held + p.gpu_milli)
                        free[j][g] += p.gpu_milli
            else:  # whole GPUs: the first k fully free ones (which ones does not matter)
                idle = [g for g in ok if free[j][g] == MILLI]
                if len(idle) >= p.gpu_count:
                    for g in idle[: p.gpu_count]:
                        free[j][g] = 0
                    go(i + 1, held + p.gpu_milli_total)
                    for g in idle[: p.gpu_count]:
                        free[j][g] = MILLI
            cpu[j] += p.cpu_milli
            mem[j] += p.memory_mib
        go(i + 1, held)  # left unplaced

    go(0, 0)
    return best


def capacity(nodes: list[NodeSpec]) -> int:
    return sum(len(n.gpus) for n in nodes) * MILLI


def exact_bound(nodes: list[NodeSpec], pods: list[PodRequest]) -> int:
    """Lower bound on unallocated milli with the configuration LP run to convergence."""
    return lower_bound(nodes, pods, config_rounds=50).unallocated_milli


# (nodes, pods, true minimum of unallocated milli) where the LP is integral: the bound must be exact
INTEGRAL = [
    pytest.param([node("a", 1)], [pod("p", 1, 600), pod("q", 1, 600)], 400, id="two-shares-cannot-pair"),
    pytest.param([node("a", 1), node("b", 1)], [pod("p", 1, 700), pod("q", 1, 700), pod("r", 1, 300)], 300,
                 id="one-filler-for-two-shares"),
    pytest.param([node("a", 1, "V100M16"), node("b", 1)],
                 [pod("p", 1, MILLI, models="V100M16"), pod("q", 1, MILLI, models="V100M16"), pod("r", 1, 500)],
                 500, id="models"),
    pytest.param([node("a", 2), node("b", 2)], [pod("p", 2, MILLI), pod("q", 1, MILLI), pod("r", 1, 250)], 750,
                 id="multi-gpu-and-whole-and-share"),
]


@pytest.mark.parametrize(("nodes", "pods", "minimum"), INTEGRAL)
def test_the_bound_is_exact_where_the_lp_is_integral(nodes, pods, minimum):
    assert capacity(nodes) - brute_max_allocated(nodes, pods) == minimum  # the case is what it says
    assert exact_bound(nodes, pods) == minimum
    assert lower_bound(nodes, pods).unallocated_milli == minimum


def test_the_configuration_lp_is_strictly_tighter_where_cpu_binds():
    # each node has CPU for one 2-core pod only; in aggregate (6 cores) three would fit
    nodes = [node("a", 2, cpu=3000), node("b", 2, cpu=3000)]
    pods = [pod(f"p{i}", 1, MILLI, cpu=2000) for i in range(3)]
    truth = capacity(nodes) - brute_max_allocated(nodes, pods)
    assert truth == 2000
    pattern_only = lower_bound(nodes, pods, config_rounds=0).unallocated_milli
    assert pattern_only == 1000
    assert exact_bound(nodes, pods) == truth > pattern_only


def random_case(rng: random.Random) -> tuple[list[NodeSpec], list[PodRequest]]:
    models = ("T4", "V100M16")
    nodes = [node(f"n{i}", rng.choice((1, 2, 2, 3)), rng.choice(models), cpu=rng.choice((4000, 8000, 16000)),
                  mem=rng.choice((8192, 32768))) for i in range(rng.choice((2, 3)))]
    pods = []
    for i in range(rng.randint(3, 7)):
        share = rng.random() < 0.55
        gpus, milli = (1, rng.choice((150, 300, 450, 500, 650, 810))) if share else (rng.choice((1, 1, 2, 3)), MILLI)
        pods.append(pod(f"p{i}", gpus, milli, cpu=rng.choice((1000, 3000, 6000)), mem=rng.choice((1024, 8192)),
                        models=rng.choice(("", "", "T4", "V100M16", "T4|V100M16"))))
    return nodes, pods


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_never_exceeds_the_true_minimum(seed):
    nodes, pods = random_case(random.Random(seed))
    truth = capacity(nodes) - brute_max_allocated(nodes, pods)
    inst = instance(nodes, pods)
    pattern = pattern_lp(inst)
    config = config_lp(inst, pattern.duals, max_rounds=50)
    assert pattern.converged and config.converged
    # every relaxation's optimum is at least OPT; the configuration LP is the tighter relaxation
    assert capacity(nodes) - pattern.value <= truth + 1e-6
    assert capacity(nodes) - config.value <= truth + 1e-6
    assert config.value <= pattern.value + 1e-6
    # CPU and memory per type in aggregate: a relaxation between the two
    aggregate = pattern_lp(inst, with_cpu=True)
    assert aggregate.converged and config.value - 1e-6 <= aggregate.value <= pattern.value + 1e-6
    assert 0 <= exact_bound(nodes, pods) <= truth
    assert 0 <= lower_bound(nodes, pods).unallocated_milli <= truth


def test_random_cases_include_binding_and_slack_ones():
    """The random cases above are not all trivially exact (or all loose): the test would notice a bound
    that is always 0 or always the truth."""
    gaps = []
    for seed in range(40):
        nodes, pods = random_case(random.Random(seed))
        gaps.append(capacity(nodes) - brute_max_allocated(nodes, pods) - exact_bound(nodes, pods))
    assert any(g == 0 for g in gaps)
    assert sum(exact_bound(*random_case(random.Random(s))) > 0 for s in range(40)) >= 10


def test_measured_prefix_is_the_last_event_the_100_percent_point_averages():
    pods = [pod(f"p{i}", 1, 500) for i in range(10)]  # 2 GPUs: arrivals at 25%, 50%, ... 250%
    assert measured_prefix(pods, 2) == 4  # 100% after the fourth pod
    assert measured_prefix(pods[:3], 2) == 3  # short of 100%: the last arrival
    jump = [pod("a", 1, 500), pod("b", 2, MILLI), pod("c", 1, 500)]  # 2 GPUs: 25%, 125%, 150%
    assert measured_prefix(jump, 2) == 2  # no event near 100%: the first arrival past it
