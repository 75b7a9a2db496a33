"""Simulation results as data (JSON via pydantic) and as a terminal table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

from gpupool_sched.simulate.metrics import allocation_curve
from gpupool_sched.simulate.replay import ReplayResult


class CurvePoint(BaseModel):
    arrived_pct: int
    allocated_pct: float


class FinalMetrics(BaseModel):
    """The cluster when arriving GPU requests reach 100% of its capacity (or, when the curve has no point at
    100%, at the point the replay did reach: see ``arrived_pct``)."""

    arrived_pct: float = Field(
        description="arrived GPU requests, % of capacity, where these numbers were measured: 100 when the curve "
        "has a point there; otherwise the first arrival that passed 100% (one pod jumped over it, as on a "
        "small trace) or the last arrival of a replay that never reached it (--ratio below 1)",
    )
    allocated_pct: float = Field(description="allocated GPU capacity, % (the curve at 100% arrived, or at arrived_pct)")
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


class BoundReport(BaseModel):
    """A lower bound on the unallocated GPU capacity any policy leaves on the same arrivals (bound.py)."""

    policy: str = "bound"
    trace: str
    seed: int
    event_order: str | None = None
    total_gpus: int
    pods: int = Field(description="the arrivals bounded: those the reports' numbers at 100% arrived cover")
    unallocated_pct: float = Field(description="lower bound on unallocated GPU capacity, %, rounded down")
    unallocated_gpus: float = Field(description="the same in GPUs")
    max_allocated_milli: int = Field(description="upper bound on the GPU milli any placement of those pods holds")
    pattern_lp_converged: bool
    config_lp: str | None = Field(
        default=None, description="configuration LP: 'converged' (its optimum), 'lagrangian' (a bound from "
        "its duals) or null (not run)"
    )
    seconds: float = Field(description="wall time of the bound")


def report_json(reports: Sequence[SimulationReport], bound: BoundReport | None = None) -> object:
    """The --json payload: one report as an object, several (or one with the bound) as a list; the bound is
    the list's last entry (``"policy": "bound"``)."""
    items: list[dict] = [r.model_dump() for r in reports] + ([bound.model_dump()] if bound else [])
    return items[0] if len(items) == 1 and not bound else items


def final_point(result: ReplayResult, curve: dict[int, float]) -> tuple[float, float]:
    """(arrived %, allocated %) where the final metrics are read: the curve at 100% when it has that point;
    otherwise the event the replay measured fragmentation and failed pods at (the first arrival reaching
    the capacity, or the last arrival when none did), with its own arrived and allocated %. A missing
    curve point is never read as 0."""
    if 100 in curve:
        return 100.0, curve[100]
    capacity = result.total_gpus * 1000
    if capacity <= 0 or result.arrived_milli.size == 0:
        raise ValueError("a replay without GPU capacity or events has no final point")
    reached = np.flatnonzero(result.arrived_milli >= capacity)
    i = int(reached[0]) if reached.size else result.arrived_milli.size - 1
    return (round(100.0 * float(result.arrived_milli[i]) / capacity, 2),
            round(100.0 * float(result.used_milli[i]) / capacity, 2))


def build_report(result: ReplayResult, trace: str, seed: int, event_order: str | None) -> SimulationReport:
    curve = allocation_curve(result.arrived_milli, result.used_milli, result.total_gpus)
    arrived_pct, at_full = final_point(result, curve)
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
            arrived_pct=arrived_pct,
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


def off_full(reports: Sequence[SimulationReport]) -> list[str]:
    """Why the reports' final numbers are not read at 100% arrived (empty when they are). The arrivals are
    the same for every policy of a run, so is the point."""
    notes = []
    for at in sorted({r.final.arrived_pct for r in reports} - {100.0}):
        if at > 100.0:
            notes.append(f"no arrival landed within 1 point of 100% of GPU capacity (one pod took the arrivals "
                         f"past it): the numbers are measured at {at:.2f}% arrived, the first arrival past 100%")
        else:
            notes.append(f"the arrivals end at {at:.2f}% of GPU capacity, short of 100%: the numbers are measured "
                         f"there, at the last arrival")
    return notes


def render_table(reports: Sequence[SimulationReport], bound: BoundReport | None = None):
    from rich.table import Table

    first: SimulationReport | BoundReport = reports[0] if reports else bound  # type: ignore[assignment]
    notes = off_full(reports)
    caption = TABLE_CAPTION
    if notes:
        caption = TABLE_CAPTION.replace("measured when arrivals reach 100% of GPU capacity", "measured at the "
                                        "'arrived %' column (100% of GPU capacity when the curve has that point)")
    table = Table(
        title=f"trace {first.trace}: {first.total_gpus} GPUs, {first.pods} arrivals"
        f"{'' if reports else ' up to 100%'}, seed {first.seed}",
        caption=caption,
        caption_justify="left",
    )
    columns = ["policy", "allocated %", "unallocated %", "fragmented %", "failed pods", "seconds"]
    if notes:
        columns.insert(1, "arrived %")
    for col in columns:
        table.add_column(col, justify="left" if col == "policy" else "right")
    best = min((r.final.unallocated_pct for r in reports), default=0.0)
    for r in reports:
        f = r.final
        mark = "bold green" if f.unallocated_pct == best and len(reports) > 1 else None
        table.add_row(
            r.policy,
            *([f"{f.arrived_pct:.2f}"] if notes else []),
            f"{f.allocated_pct:.2f}",
            f"{f.unallocated_pct:.2f}",
            f"{f.fragmented_pct:.2f}",
            str(f.failed_pods),
            f"{f.seconds:.1f}",
            style=mark,
        )
    if bound is not None:
        table.add_row(
            "bound (any policy)",
            *([f"{reports[0].final.arrived_pct:.2f}"] if notes else []),
            f"<= {100 - bound.unallocated_pct:.2f}",
            f">= {bound.unallocated_pct:.2f}",
            "",
            "",
            f"{bound.seconds:.1f}",
            style="italic",
        )
        table.caption = f"{table.caption}; bound: no placement of the same arrivals leaves fewer GPUs unallocated"
    return table
