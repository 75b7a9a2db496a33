"""The what-if's answer per policy: a summary row (pods placed and still pending, GPUs allocated and
fragmented, preemptions, moves) and every decision (pod -> node and GPUs, victims, moves)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table

from gpupool_sched.model.request import MILLI
from gpupool_sched.simulate.dryrun import Outcome


def summary(outcome: Outcome) -> dict[str, Any]:
    bound = {key for key, d in outcome.decisions.items() if d.node is not None and d.evicted_by is None}
    pending_placed = sum(1 for key in outcome.pending if key in bound)
    synthetic_placed = sum(1 for key in outcome.synthetic if key in bound)
    evicted = sum(1 for key in (*outcome.pending, *outcome.synthetic)
                  if key in outcome.decisions and outcome.decisions[key].evicted_by is not None)
    capacity = outcome.total_gpus * MILLI
    return {
        "policy": outcome.policy,
        "pending": len(outcome.pending),
        "pending_placed": pending_placed,
        "continuation": len(outcome.synthetic),
        "continuation_placed": synthetic_placed,
        "evicted_after_placing": evicted,  # placed, then a later decision's victim
        "still_pending": len(outcome.pending) + len(outcome.synthetic) - pending_placed - synthetic_placed - evicted,
        "total_gpus": outcome.total_gpus,
        "allocated_percent": round(100.0 * outcome.allocated_milli / capacity, 2) if capacity else 0.0,
        "fragmented_gpus": round(outcome.fragmented_milli / MILLI, 3),
        "preemptions": sum(len(d.victims) for d in outcome.decisions.values()),
        "moves": sum(len(d.moves) for d in outcome.decisions.values()),
        "unsettled": list(outcome.unsettled),
    }


def report_json(outcomes: list[Outcome], *, server: str, scheduler_name: str, seed: int,
                continuation: int) -> dict[str, Any]:
    return {
        "server": server,
        "scheduler_name": scheduler_name,
        "seed": seed,
        "continuation": continuation,
        "policies": [
            {**summary(o),
             "decisions": [{k: v for k, v in asdict(d).items() if v not in (None, [])}
                           for d in o.decisions.values()]}
            for o in outcomes
        ],
    }


def render_table(outcomes: list[Outcome]) -> Table:
    table = Table(title="What-if on the live cluster", title_justify="left",
                  caption="placed: of the pending pods; continuation: synthetic pods placed; evicted: of both, "
                          "placed and then preempted; pending: of both, still waiting; fragmented: GPUs (FGD); "
                          "preempted / moved: pods evicted / moved",
                  caption_justify="left")
    for name, justify in (("policy", "left"), ("placed", "right"), ("continuation", "right"),
                          ("evicted", "right"), ("pending", "right"), ("GPUs allocated", "right"),
                          ("fragmented", "right"),
                          ("preempted", "right"), ("moved", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for outcome in outcomes:
        s = summary(outcome)
        table.add_row(s["policy"], f"{s['pending_placed']}/{s['pending']}",
                      f"{s['continuation_placed']}/{s['continuation']}", str(s["evicted_after_placing"]),
                      str(s["still_pending"]),
                      f"{s['allocated_percent']:.1f}% of {s['total_gpus']}", f"{s['fragmented_gpus']:.2f}",
                      str(s["preemptions"]), str(s["moves"]))
    return table
