"""Scoring a sample of the feasible nodes (kube-scheduler's percentageOfNodesToScore)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sched.cli import main as gpupool_main
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.sampling import NodeSampler, nodes_to_score
from tests.support.clusters import gpu_node


@pytest.mark.parametrize(
    ("nodes", "percentage", "expected"),
    [
        (0, 0, 0),
        (1, 0, 1),
        (50, 0, 50),  # small clusters: every node
        (99, 30, 99),
        (100, 0, 100),  # 50% of 100 is below the floor of 100
        (500, 0, 230),  # adaptive: 50 - 500/125 = 46%
        (1000, 0, 420),  # 42%
        (1213, 0, 497),  # openb: 41%
        (5000, 0, 500),  # 10%
        (10_000, 0, 500),  # 50 - 80 < 5: 5%
        (20_000, 0, 1000),  # 5%
        (1000, 10, 100),
        (1000, 5, 100),  # 50 nodes, raised to the floor
        (5000, 50, 2500),
        (20_000, 1, 200),
        (20_000, 100, 20_000),
    ],
)
def test_how_many_nodes_are_scored_follows_kube_scheduler(nodes, percentage, expected):
    assert nodes_to_score(nodes, percentage) == expected


@pytest.mark.parametrize("percentage", [-1, 101])
def test_percentage_out_of_range_is_refused(percentage):
    with pytest.raises(ValueError, match="percentage"):
        NodeSampler(1000, percentage)


def test_a_small_cluster_scores_every_feasible_node_and_does_not_rotate():
    sampler = NodeSampler(60, 10)
    feasible = np.arange(0, 60, 2)
    for _ in range(3):
        assert np.array_equal(sampler(feasible), feasible)
    assert sampler.next_start == 0


def test_successive_decisions_look_at_successive_parts_of_the_cluster():
    sampler = NodeSampler(1000, 10, rotate=True)  # 100 nodes per decision
    everything = np.arange(1000)
    seen = [sampler(everything) for _ in range(11)]
    for i, s in enumerate(seen[:10]):
        assert np.array_equal(s, np.arange(100 * i, 100 * (i + 1)))
    assert np.array_equal(seen[10], np.arange(100))  # round the ring


def test_the_scan_wraps_and_the_sample_stays_ascending():
    sampler = NodeSampler(1000, 10, rotate=True, start=950)
    feasible = np.arange(0, 1000, 2)  # even nodes
    kept = sampler(feasible)
    assert kept.size == 100
    assert np.array_equal(kept, np.concatenate((np.arange(0, 150, 2), np.arange(950, 1000, 2))))
    assert sampler.next_start == 150  # the first feasible node after the last one taken (148)


def test_the_next_scan_starts_at_the_next_feasible_node():
    sampler = NodeSampler(1000, 10, rotate=True, start=10)
    feasible = np.array([3, *range(20, 1000, 5)])
    kept = sampler(feasible)
    assert kept[0] == 20 and kept.size == 100 and 3 not in kept
    assert sampler.next_start == int(kept[-1]) + 5  # the next feasible node


def test_by_default_every_scan_starts_at_the_beginning():
    sampler = NodeSampler(1000, 10, start=500)
    everything = np.arange(1000)
    for _ in range(3):
        assert np.array_equal(sampler(everything), np.arange(100))
    assert np.array_equal(sampler(np.arange(500, 1000)), np.arange(500, 600))


def test_the_scan_follows_the_given_order():
    order = np.arange(1000)[::-1]
    sampler = NodeSampler(1000, 10, rotate=False, order=order)
    assert np.array_equal(sampler(np.arange(1000)), np.arange(900, 1000))


def test_resize_follows_nodes_joining_and_leaving():
    sampler = NodeSampler(1000, 0, start=900)
    assert sampler.count == 420
    sampler.resize(800)
    assert sampler.count == nodes_to_score(800, 0) and sampler.next_start == 100
    with pytest.raises(ValueError, match="sized for 800"):
        sampler(np.arange(1000))
    with pytest.raises(ValueError, match="permutation"):
        sampler.resize(3, order=np.array([0, 0, 1]))


def naive_scan(num_nodes, count, start, order, feasible):
    """kube-scheduler's loop, run sequentially: visit nodes from the start and keep feasible ones; the
    scan stops at the first feasible node beyond ``count`` (not kept) or when it has been round the ring;
    the next start is the first node not processed."""
    kept, infeasible = [], 0
    for step in range(num_nodes):
        node = int(order[(start + step) % num_nodes])
        if node not in feasible:
            infeasible += 1
        elif len(kept) == count:
            break
        else:
            kept.append(node)
    return sorted(kept), (start + len(kept) + infeasible) % num_nodes


@settings(max_examples=60, deadline=None)
@given(
    num_nodes=st.integers(100, 400),
    percentage=st.sampled_from([0, 1, 10, 30, 60, 100]),
    start=st.integers(0, 10_000),
    shuffle=st.booleans(),
    rotate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_sampler_is_kube_schedulers_scan_on_index_arrays(num_nodes, percentage, start, shuffle, rotate, seed):
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_nodes) if shuffle else np.arange(num_nodes)
    kwargs = {"start": start, "rotate": rotate, "order": order if shuffle else None}
    sampler, twin = NodeSampler(num_nodes, percentage, **kwargs), NodeSampler(num_nodes, percentage, **kwargs)
    pos = start % num_nodes if rotate else 0
    for _ in range(8):
        feasible = np.flatnonzero(rng.random(num_nodes) < rng.uniform(0.05, 1.0))
        if feasible.size == 0:
            continue
        expected, after = naive_scan(num_nodes, sampler.count, pos, order, set(feasible.tolist()))
        kept = sampler(feasible)
        assert kept.tolist() == expected  # the kube-scheduler scan ...
        assert kept.size == min(sampler.count, feasible.size) > 0  # ... never empty ...
        assert np.array_equal(twin(feasible), kept)  # ... and deterministic
        if rotate:
            pos = after
            assert sampler.next_start == pos


def test_for_snapshot_scans_in_the_tie_break_order():
    nodes = [gpu_node(f"n{i:03d}", 1) for i in range(200)]
    snap = ClusterSnapshot(nodes, tie_order=[f"z{199 - i:03d}" for i in range(200)])  # reversed
    sampler = NodeSampler.for_snapshot(snap, 50, rotate=False)
    assert np.array_equal(sampler(np.arange(200)), np.arange(100, 200))


def test_follow_keeps_up_with_nodes_joining_and_leaving():
    snap = ClusterSnapshot([gpu_node(f"n{i:03d}", 1) for i in range(1, 301)])
    sampler = NodeSampler.for_snapshot(snap, 10)
    assert sampler.count == 100 and sampler.follow(snap) is sampler
    snap.upsert_node(gpu_node("n000", 1))  # joins at the end of the rows, first in the tie order
    kept = sampler.follow(snap)(np.arange(len(snap)))
    assert sampler.num_nodes == 301 and snap.row_of("n000") in kept.tolist()
    for i in range(1, 203):
        snap.remove_node(f"n{i:03d}")
    kept = sampler.follow(snap)(np.arange(len(snap)))
    assert sampler.count == len(snap) == 99 and kept.size == 99  # fewer than 100 nodes: all of them


PROFILE = WorkloadProfile.from_requests([PodRequest(name="w", cpu_milli=1000, gpu_count=1, gpu_milli=1000)])


@pytest.mark.parametrize("policy", ["fgd", "gpupool", "best-fit"])
def test_decide_places_on_a_sampled_node(policy):
    nodes = [gpu_node(f"n{i:03d}", 2) for i in range(300)]
    snap = ClusterSnapshot(nodes)
    pod = PodRequest(name="p", cpu_milli=1000, gpu_count=1, gpu_milli=500)
    snap.assume(pod, Placement(node="n299", gpu_indices=(0,), gpu_milli=500))  # the best node for a share
    sampler = NodeSampler(len(snap), 0, rotate=True, start=10)
    d = decide(snap, pod, build_policy(policy, PROFILE), sample=sampler)
    assert isinstance(d, Placement)
    assert 10 <= snap.index[d.node] < 10 + sampler.count  # n299 was not in the sample
    full = decide(snap, pod, build_policy(policy, PROFILE))
    assert isinstance(full, Placement) and full.node == "n299"


def test_the_simulator_flag_samples_and_rejects_bad_percentages(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,131072,2,T4\n" for i in range(120)))
    pods = tmp_path / "openb_pod_list_tiny.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        + "".join(f"p{i},2000,4096,1,{(250, 500, 1000)[i % 3]}\n" for i in range(60))
    )
    base = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd"]
    curves = {}
    for flag in (
        [],
        ["--sample-percentage", "100"],
        ["--sample-percentage", "0"],
        ["--sample-percentage", "0", "--sample-scan", "rotating"],
    ):
        out = tmp_path / f"r{len(curves)}.json"
        assert gpupool_main([*base, *flag, "--json", str(out)]) == 0
        curves[" ".join(flag)] = json.loads(out.read_text())["curve"]
    assert curves["--sample-percentage 100"] == curves[""]  # scoring 100% of the nodes is no sampling
    assert curves["--sample-percentage 0"][-1]["allocated_pct"] > 50
    assert curves["--sample-percentage 0 --sample-scan rotating"][-1]["allocated_pct"] > 50
    assert gpupool_main([*base, "--sample-percentage", "101"]) == 2
    assert "--sample-percentage must be in 0..100" in capsys.readouterr().err
