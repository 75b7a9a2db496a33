"""What one preemption plan costs at scale, kube-scheduler's candidate sampling against the full search
(issue 18), on the same cluster in the same run:

    make bench-preemption      # = python -m benchmarks.bench_preemption --out out/bench

1,000 nodes of 8 GPUs, each GPU held by a whole-GPU pod of priority 0, 1 or 2 (random start times): every
node could serve a 2-GPU pod of priority 10 by evicting two pods of priority 0, which is the case where the
full search costs most (it releases and reprieves 8,000 pods). ``plan_preemption`` with the default
``CandidateBudget`` (10 % of the potential nodes, at least 100) against ``FULL_SEARCH`` (every node),
alternated repetition by repetition so that the machine's other load falls on both alike. Each sample:
wall time (``time.perf_counter``) and the CPU time of the thread (``time.thread_time``). Both answers are
valid plans with the same victim priorities; which node wins may differ (sampling chooses among the
candidates it tried).

Writes <out>/preemption.json and <out>/preemption.md and prints the table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpupool_sched.model.cluster import ClusterSnapshot, GpuSpec, NodeSpec
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.candidates import FULL_SEARCH, CandidateBudget
from gpupool_sched.placement.preemption import RunningPod, plan_preemption
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.placement.workload import default_prior

HIGH = 10
GPU_MEM = 81_920


@dataclass
class Result:
    search: str
    nodes: int
    pods: int
    repetitions: int
    considered: int  # nodes whose lower-priority pods were released
    median_s: float
    median_cpu_s: float
    min_s: float
    victims: int
    top_victim_priority: int


def cluster(nodes: int, gpus: int, seed: int) -> tuple[ClusterSnapshot, list[RunningPod]]:
    rng = np.random.default_rng(seed)
    specs = [NodeSpec(name=f"node-{k:04d}", cpu_milli=128_000, memory_mib=1_024_000,
                      gpus=tuple(GpuSpec(index=j, model="H100", memory_mib=GPU_MEM, uuid=f"GPU-{k}-{j}")
                                 for j in range(gpus)))
             for k in range(nodes)]
    snap = ClusterSnapshot(specs)
    running = []
    for spec in specs:
        for j in range(gpus):
            priority = int(rng.integers(3))
            request = PodRequest(name=f"{spec.name}-{j}", cpu_milli=4000, memory_mib=32_000, gpu_count=1,
                                 gpu_milli=1000, priority=priority)
            placement = Placement(spec.name, (j,), 1000, GPU_MEM)
            snap.assume(request, placement)
            running.append(RunningPod(request.name, spec.name, priority, request, placement,
                                      float(rng.integers(1_000_000))))
    return snap, running


def measure(nodes: int, gpus: int, repetitions: int, seed: int) -> list[Result]:
    snap, running = cluster(nodes, gpus, seed)
    policy = build_policy("gpupool", default_prior())
    request = PodRequest(name="preemptor", cpu_milli=8000, memory_mib=64_000, gpu_count=2, gpu_milli=1000,
                         priority=HIGH)
    searches: dict[str, CandidateBudget] = {"full search": FULL_SEARCH, "sampled (default)": CandidateBudget()}
    wall: dict[str, list[float]] = {k: [] for k in searches}
    cpu: dict[str, list[float]] = {k: [] for k in searches}
    last = {}
    plan_preemption(snap, request, HIGH, running, policy, budget=CandidateBudget())  # warm the caches
    for _ in range(repetitions):
        for name, budget in searches.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            plan = plan_preemption(snap, request, HIGH, running, policy, np.random.default_rng(seed), budget=budget)
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
            assert plan is not None
            last[name] = plan
    return [Result(name, nodes, nodes * gpus, repetitions, last[name].considered,
                   round(statistics.median(wall[name]), 4), round(statistics.median(cpu[name]), 4),
                   round(min(wall[name]), 4), len(last[name].victims),
                   max(v.priority for v in last[name].victims))
            for name in searches]


def table(results: list[Result]) -> str:
    lines = ["| search | nodes | pods | nodes tried | median (s wall) | median (s CPU) | min (s wall) | victims "
             "| top victim priority |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.search} | {r.nodes} | {r.pods} | {r.considered} | {r.median_s:.4f} | "
                     f"{r.median_cpu_s:.4f} | {r.min_s:.4f} | {r.victims} | {r.top_victim_priority} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs (and pods) per node")
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.nodes, args.gpus, args.repetitions) <= 0 or args.gpus < 2:
        parser.error("sizes must be positive, and --gpus at least 2")
    full, sampled = measure(args.nodes, args.gpus, args.repetitions, args.seed)
    ratio = {"wall": round(full.median_s / sampled.median_s, 1),
             "cpu": round(full.median_cpu_s / sampled.median_cpu_s, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preemption.json").write_text(json.dumps(
        {"results": [asdict(full), asdict(sampled)], "full_over_sampled": ratio}, indent=2) + "\n")
    text = (table([full, sampled]) + f"\n\nfull / sampled (median): x{ratio['wall']} wall, x{ratio['cpu']} CPU")
    (args.out / "preemption.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
