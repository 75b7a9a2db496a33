"""`make bench-sim`: simulator wall time per policy on the bundled default trace, and the cost of
one placement decision at 1k, 5k and 20k nodes (synthetic clusters with the trace's node mix).

Speed is reported as absolute times and as ratios to random-fit measured in the same run (the
cheapest policy: filters plus a constant score), since these machines are noisy. The decision cost
of the profile-driven policies is measured again with a NodeSampler (kube-scheduler's
percentageOfNodesToScore, 0 = adaptive), as ratios to the same policy scoring every feasible node.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.decide import decide
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import POLICIES, build_policy
from gpupool_sched.placement.sampling import NodeSampler, nodes_to_score
from gpupool_sched.simulate.run import prepare_workload, simulate
from gpupool_sched.simulate.trace import read_trace

BASELINE = "random"


def synthetic_cluster(trace_nodes: Sequence[NodeSpec], size: int, rng: np.random.Generator) -> list[NodeSpec]:
    """``size`` nodes drawn from the trace's node mix, named node-00000..."""
    picks = rng.integers(len(trace_nodes), size=size)
    return [replace(trace_nodes[int(i)], name=f"node-{k:05d}") for k, i in enumerate(picks)]


def decision_cost(
    nodes: list[NodeSpec],
    pods: Sequence[PodRequest],
    policy_name: str,
    profile: WorkloadProfile,
    fill: float,
    decisions: int,
    seed: int,
    sample_percentage: int | None = None,
) -> list[float]:
    """Seconds per decision on a cluster pre-filled to ``fill`` of its GPU capacity (the same cluster
    and pods for a given seed, with or without sampling)."""
    rng = np.random.default_rng(seed)
    snap = ClusterSnapshot(nodes)
    policy = build_policy(policy_name, profile)
    fill_randomly(snap, pods, fill, rng)
    sampler = NodeSampler.for_snapshot(snap, sample_percentage) if sample_percentage is not None else None
    times = []
    for _ in range(decisions):
        pod = replace(pods[int(rng.integers(len(pods)))], cpu_milli=int(rng.integers(1, 16)) * 500)  # defeat memo
        start = time.perf_counter()
        decide(snap, pod, policy, rng, sample=sampler)
        times.append(time.perf_counter() - start)
    return times


def fill_randomly(snap: ClusterSnapshot, pods: Sequence[PodRequest], fill: float, rng: np.random.Generator) -> None:
    """Bring the cluster to a realistic, partly used state: random pods on random nodes where they fit."""
    target = fill * snap.total_gpu_milli
    used = 0
    while used < target:
        pod = pods[int(rng.integers(len(pods)))]
        i = int(rng.integers(len(snap)))
        if snap.cpu_free[i] < pod.cpu_milli or snap.mem_free[i] < pod.memory_mib:
            continue
        free = snap.free_milli[i]
        fits = np.flatnonzero(free >= pod.gpu_milli if pod.is_shared else free == 1000)
        if pod.wants_gpu and fits.size < pod.gpu_count:
            continue
        gpus = tuple(int(j) for j in fits[: pod.gpu_count]) if pod.wants_gpu else ()
        snap.assume(pod, Placement(node=snap.nodes[i].name, gpu_indices=gpus, gpu_milli=pod.gpu_milli))
        used += pod.gpu_milli_total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    ap.add_argument("--sizes", default="1000,5000,20000")
    ap.add_argument("--decisions", type=int, default=30)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sample-policies", default="fgd,gpupool", help="policies timed again with a sampler")
    ap.add_argument("--sample-percentages", default="0,10", help="0 = adaptive; empty: no sampling runs")
    args = ap.parse_args(argv)
    percentages = [int(p) for p in args.sample_percentages.split(",") if p]
    names = args.policies.split(",")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    trace = read_trace()  # bundled openb default trace
    workload = prepare_workload(trace, seed=42)
    result: dict = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "trace": trace.name,
        "arrivals": len(workload.arrivals),
        "nodes": len(trace.nodes),
        "replay": {},
        "decision": {},
        "sampled": {},
    }
    print(f"replaying {len(workload.arrivals)} arrivals on {len(trace.nodes)} nodes per policy ...", file=sys.stderr)
    for name in names:
        report = simulate(trace, workload, [name])[0]
        result["replay"][name] = {"seconds": report.final.seconds, "allocated_pct": report.final.allocated_pct}
        print(f"  {name:15s} {report.final.seconds:6.1f} s", file=sys.stderr)
    rng = np.random.default_rng(7)
    for size in (int(s) for s in args.sizes.split(",")):
        nodes = synthetic_cluster(trace.nodes, size, rng)
        result["decision"][size] = {}
        for name in names:
            times = decision_cost(nodes, trace.pods, name, workload.profile, 0.6, args.decisions, seed=size)
            result["decision"][size][name] = {
                "p50_ms": 1000 * statistics.median(times),
                "mean_ms": 1000 * statistics.fmean(times),
            }
            print(f"  {size:6d} nodes {name:15s} {1000 * statistics.median(times):8.2f} ms/decision", file=sys.stderr)
        result["sampled"][size] = {}
        for name in args.sample_policies.split(",") if percentages else []:
            full = result["decision"][size].get(name)
            if full is None:  # not among --policies: time it unsampled here
                times = decision_cost(nodes, trace.pods, name, workload.profile, 0.6, args.decisions, seed=size)
                full = {"p50_ms": 1000 * statistics.median(times), "mean_ms": 1000 * statistics.fmean(times)}
            rows = result["sampled"][size][name] = {"all": {"scored_nodes": size, **full, "ratio_to_all": 1.0}}
            for pct in percentages:
                times = decision_cost(nodes, trace.pods, name, workload.profile, 0.6, args.decisions, size, pct)
                p50 = 1000 * statistics.median(times)
                rows[str(pct)] = {
                    "scored_nodes": nodes_to_score(size, pct),
                    "p50_ms": p50,
                    "mean_ms": 1000 * statistics.fmean(times),
                    "ratio_to_all": p50 / full["p50_ms"] if full["p50_ms"] else None,
                }
                print(
                    f"  {size:6d} nodes {name:15s} {p50:8.2f} ms/decision scoring {nodes_to_score(size, pct)} nodes"
                    f" (x{rows[str(pct)]['ratio_to_all']:.2f} of all)",
                    file=sys.stderr,
                )
    base = result["replay"][BASELINE]["seconds"]
    for row in result["replay"].values():
        row["ratio_to_random"] = row["seconds"] / base if base else None
    for rows in result["decision"].values():
        b = rows[BASELINE]["p50_ms"]
        for row in rows.values():
            row["ratio_to_random"] = row["p50_ms"] / b if b else None
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "placement.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"\nJSON: {out}")
    return 0


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = list(result["decision"])
    table = Table(
        title=f"placement speed ({result['arrivals']} arrivals on {result['nodes']} nodes; ratios to random-fit)"
    )
    table.add_column("policy")
    table.add_column("replay s", justify="right")
    table.add_column("x random", justify="right")
    for size in sizes:
        table.add_column(f"{size} nodes ms/decision", justify="right")
    for name, row in result["replay"].items():
        cells = [
            f"{result['decision'][s][name]['p50_ms']:.2f} (x{result['decision'][s][name]['ratio_to_random']:.1f})"
            for s in sizes
        ]
        table.add_row(name, f"{row['seconds']:.1f}", f"{row['ratio_to_random']:.1f}", *cells)
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    sampled = {s: rows for s, rows in result["sampled"].items() if rows}
    if not sampled:
        return
    table = Table(title="scoring a sample of the feasible nodes (percentage 0 = adaptive; ratios to scoring all)")
    table.add_column("policy")
    table.add_column("percentage")
    for size in sampled:
        table.add_column(f"{size} nodes ms/decision", justify="right")
    first = next(iter(sampled.values()))
    for name, by_pct in first.items():
        for pct in by_pct:
            cells = []
            for s in sampled:
                row = sampled[s][name][pct]
                cells.append(f"{row['p50_ms']:.2f} (x{row['ratio_to_all']:.2f}, {row['scored_nodes']} nodes)")
            label = {"all": "all (baseline)", "0": "adaptive"}.get(pct, f"{pct}%")
            table.add_row(name if pct == "all" else "", label, *cells)
    Console(width=None if sys.stdout.isatty() else 140).print(table)


if __name__ == "__main__":
    sys.exit(main())
