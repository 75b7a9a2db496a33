"""Preemption's per-node memo (placement/preemption_memo.py): a plan with the memo is exactly the plan
without it, however the nodes and the candidates changed since the memo's entries were made, and an
unchanged node is not worked on again."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement import preemption
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.preemption import Preemption, plan_preemption
from gpupool_sched.placement.preemption_memo import PreemptionMemo
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.workload import default_prior
from tests.support.clusters import BEST_FIT, HIGH, Cluster, gpu_node, gpus

GB = 1024
_NEW = itertools.count()  # UIDs of pods that come between two plans
REQUESTS = [gpus(1), gpus(2), gpus(4), gpus(1, cpu=14_000),
            PodRequest(name="pre", cpu_milli=500, gpu_count=1, gpu_memory_mib=50 * GB, priority=HIGH)]


def plan(c: Cluster, request: PodRequest, memo: PreemptionMemo | None, policy: Policy = BEST_FIT,
         priority: int = HIGH) -> Preemption | None:
    return plan_preemption(c.snap, request, priority, c.pods, policy, np.random.default_rng(0), memo=memo)


def full_cluster(nodes: int, gpus_per_node: int = 4) -> Cluster:
    c = Cluster([gpu_node(f"n{k}", gpus_per_node, cpu=16_000, gpu_mem=80 * GB) for k in range(nodes)])
    for k in range(nodes):
        for j in range(gpus_per_node):
            c.whole(f"n{k}-{j}", f"n{k}", [j], priority=(k + j) % 3, start=float(10 * k + j))
    return c


@st.composite
def histories(draw: st.DrawFn) -> tuple[Cluster, list[tuple[str, int, int]]]:
    c = full_cluster(draw(st.integers(2, 6)), draw(st.integers(1, 4)))
    steps = draw(st.lists(st.tuples(st.sampled_from(["leave", "come", "block", "hide", "reprioritize", "none"]),
                                    st.integers(0, 10**6), st.integers(0, len(REQUESTS) - 1)), max_size=8))
    return c, steps


def step(c: Cluster, kind: str, pick: int) -> None:
    """One change between two plans: a pod leaves (its row changes), one comes onto a free GPU (a candidate,
    or one of the preemptor's priority: the row changes, its candidates do not), one stops being a
    candidate while still accounted (being evicted: no row change), one changes priority."""
    if kind == "none" or (not c.pods and kind != "come"):
        return
    if kind in ("come", "block"):  # "block": a pod of the preemptor's priority (no candidate) takes a GPU
        for row, spec in enumerate(c.snap.nodes):
            free = [j for j in range(len(spec.gpus)) if c.snap.free_milli[row, j] == 1000]
            if free:
                c.whole(f"new-{next(_NEW)}", spec.name, [free[pick % len(free)]],
                        priority=HIGH if kind == "block" else pick % 3, start=float(pick))
                return
        return
    pod = c.pods[pick % len(c.pods)]
    if kind == "leave":
        c.pods.remove(pod)
        c.snap.release(pod.request, pod.placement)
    elif kind == "hide":
        c.pods.remove(pod)
    else:
        c.pods[c.pods.index(pod)] = replace(pod, priority=HIGH - 1 - pod.priority)


@settings(max_examples=60, deadline=None)
@given(histories())
def test_a_plan_with_the_memo_is_the_plan_without_it(case: tuple[Cluster, list[tuple[str, int, int]]]) -> None:
    c, steps = case
    memo = PreemptionMemo()
    for request in REQUESTS:  # fill the memo for every shape
        assert plan(c, request, memo) == plan(c, request, None)
    for kind, pick, which in steps:
        step(c, kind, pick)
        request = replace(REQUESTS[which], name=f"pod-{pick}")  # another pod of a shape the memo knows
        assert plan(c, request, memo) == plan(c, request, None), (kind, pick, which)


def test_unchanged_nodes_are_not_worked_on_again(monkeypatch: pytest.MonkeyPatch) -> None:
    c = full_cluster(40)
    calls: list[int] = []
    real = preemption.fit_mask

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(preemption, "fit_mask", counted)
    memo = PreemptionMemo()
    first = plan(c, gpus(2), memo)
    assert first is not None and calls and len(memo) == 40
    calls.clear()
    assert plan(c, replace(gpus(2), name="another"), memo) == first and not calls  # every node from the memo
    victim = first.victims[0]  # the chosen node changes: it alone is worked on again
    c.pods.remove(victim)
    c.snap.release(victim.request, victim.placement)
    assert plan(c, gpus(2), memo) == plan(c, gpus(2), None) and calls


def test_another_policy_or_priority_does_not_use_the_entries() -> None:
    c = full_cluster(8)
    memo = PreemptionMemo()
    gpupool = build_policy("gpupool", default_prior())
    for policy in (BEST_FIT, gpupool, BEST_FIT):
        for priority in (1, 2, HIGH):
            assert plan(c, gpus(2), memo, policy, priority) == plan(c, gpus(2), None, policy, priority)


def test_a_kept_plan_is_ranked_at_the_nodes_tie_rank_of_now() -> None:
    """A node's plan keeps its ranking (victims, violations: final once stored) but not its tie rank:
    the tie order may change between plans without any row changing, and the memo's plans are ranked again."""
    c = Cluster([gpu_node("a", 1), gpu_node("b", 1)])
    c.whole("on-a", "a", [0], priority=1, start=5.0)
    c.whole("on-b", "b", [0], priority=1, start=5.0)
    memo = PreemptionMemo()
    first = plan(c, gpus(1), memo)
    assert first is not None and first.node == "a"  # equal plans: the tie order (names) decides
    c.snap.set_tie_order(["2", "1"])  # now b first; no row version changes, so both plans come from the memo
    again = plan(c, replace(gpus(1), name="another"), memo)
    assert again == plan(c, gpus(1), None) and again is not None and again.node == "b"
