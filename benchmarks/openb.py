"""Shared helpers for benchmarks on the openb trace (../shared/traces/openb, read-only)."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate.metrics import allocation_curve
from gpupool_sched.simulate.run import prepare_workload, simulate
from gpupool_sched.simulate.trace import Trace, read_trace

DEFAULT_TRACES = Path(
    os.environ.get("GPUPOOL_OPENB", Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb")
)
PAPER_LABEL = {name: info.label for name, info in POLICIES.items()} | {
    "gpu-packing": "GpuPacking",
    "gpu-clustering": "GpuClustering",
}
ALL_TRACES = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250",
    "gpushare40", "gpushare60", "gpushare80", "gpushare100",
    "multigpu20", "multigpu30", "multigpu40", "multigpu50",
    "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Run:
    trace: str
    policy: str
    seed: int
    alloc_at_100: float
    alloc_at_130: float
    failed_pods: int
    seconds: float


@cache
def load(trace: str, root: Path = DEFAULT_TRACES) -> Trace:
    return read_trace(root / "openb_node_list_gpu_node.csv", root / f"openb_pod_list_{trace}.csv")


def replay_published(trace: str, policy: str, seed: int, root: Path = DEFAULT_TRACES) -> Run:
    """One policy on one published run (pod order and node tie-breaks of the paper's artifact)."""
    t = load(trace, root)
    workload = prepare_workload(t, seed, root / "sim_event_order" / f"openb_pod_list_{trace}.order.csv.gz")
    report = simulate(t, workload, [policy])[0]
    curve = {p.arrived_pct: p.allocated_pct for p in report.curve}
    return Run(
        trace,
        policy,
        seed,
        curve[100],
        curve.get(130, curve[max(curve)]),
        report.final.failed_pods,
        report.final.seconds,
    )


def paper_values(root: Path = DEFAULT_TRACES) -> dict[tuple[str, str, int], tuple[float, float]]:
    """(trace, paper policy label, seed) -> (allocated % at 100% arrived, at 130%)."""
    with open(root / "paper_alloc.csv", newline="") as f:
        return {
            (r["workload"], r["policy"], int(r["seed"])): (float(r["alloc_at_100"]), float(r["alloc_at_130"]))
            for r in csv.DictReader(f)
        }


__all__ = [
    "ALL_TRACES",
    "DEFAULT_TRACES",
    "PAPER_LABEL",
    "Run",
    "allocation_curve",
    "load",
    "paper_values",
    "replay_published",
]
