"""Simulation results as data (JSON via pydantic) and as a terminal table."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from gpupool_sched.simulate.metrics import allocation_curve
from gpupool_sched.simulate.replay import ReplayResult


class CurvePoint(BaseModel):
    arrived_pct: int
    allocated_pct: float


class FinalMetrics(BaseModel):
    """The cluster when arriving GPU requests reach 100% of its capacity."""

    allocated_pct: float = Field(description="allocated GPU capacity, % (the curve at 100% arrived)")
    unallocated_pct: float = Field(description="100 - allocated_pct")
    fragmented_pct: float = Field(description="idle GPU capacity that the workload's task classes cannot use, %")
    failed_pods: int = Field(
        description="arrivals that found no node with room, counted until arrivals reach 100% of the GPU "
        "capacity (a failed pod is never retried); the table's 'failed pods' column"
    )
    seconds: float = Field(description="wall time of the whole replay")


class SimulationReport(BaseModel):
    policy: str
    trace: str
    seed: int
    event_order: str | None = None
    total_gpus: int
    pods: int = Field(description="arrivals replayed (up to --ratio, default 130%, of GPU capacity)")
    failed_pods_total: int = Field(
        description="arrivals that found no node with room over the whole replay (up to --ratio x capacity); "
        "final.failed_pods counts only those up to 100% arrived"
    )
    curve: list[CurvePoint]
    final: FinalMetrics


def build_report(result: ReplayResult, trace: str, seed: int, event_order: str | None) -> SimulationReport:
    curve = allocation_curve(result.arrived_milli, result.used_milli, result.total_gpus)
    at_full = curve.get(100, 0.0)
    return SimulationReport(
        policy=result.policy,
        trace=trace,
        seed=seed,
        event_order=event_order,
        total_gpus=result.total_gpus,
        pods=result.pods,
        failed_pods_total=int(result.failed.sum()),
        curve=[CurvePoint(arrived_pct=x, allocated_pct=v) for x, v in sorted(curve.items())],
        final=FinalMetrics(
            allocated_pct=at_full,
            unallocated_pct=round(100.0 - at_full, 2),
            fragmented_pct=round(100.0 * result.fragmented_milli_at_full / (result.total_gpus * 1000), 2),
            failed_pods=result.failed_at_full,
            seconds=round(result.seconds, 2),
        ),
    )


TABLE_CAPTION = (
    "measured when arrivals reach 100% of GPU capacity; failed pods: arrivals that found no node with room "
    "by then (never retried); the JSON's failed_pods_total counts them over the whole replay"
)


def render_table(reports: Sequence[SimulationReport]):
    from rich.table import Table

    first = reports[0]
    table = Table(
        title=f"trace {first.trace}: {first.total_gpus} GPUs, {first.pods} arrivals, seed {first.seed}",
        caption=TABLE_CAPTION,
        caption_justify="left",
    )
    for col in ("policy", "allocated %", "unallocated %", "fragmented %", "failed pods", "seconds"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    best = min(r.final.unallocated_pct for r in reports)
    for r in reports:
        f = r.final
        mark = "bold green" if f.unallocated_pct == best and len(reports) > 1 else None
        table.add_row(
            r.policy,
            f"{f.allocated_pct:.2f}",
            f"{f.unallocated_pct:.2f}",
            f"{f.fragmented_pct:.2f}",
            str(f.failed_pods),
            f"{f.seconds:.1f}",
            style=mark,
        )
    return table
