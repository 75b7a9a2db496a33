"""`gpupool simulate`: replay a cluster trace through placement policies."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from gpupool_sched.errors import UserError
from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate.run import prepare_workload, simulate
from gpupool_sched.simulate.trace import TraceError, read_trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a GPU cluster trace through placement policies (FGD paper method)",
        description=(
            "Replay Alibaba cluster-trace-gpu-v2023 style node and pod lists (the bundled openb default "
            "trace when --nodes/--pods are omitted): pods arrive in a seeded order, copies are sampled up to "
            "130%% of GPU capacity, nothing leaves and failed pods are not retried."
        ),
    )
    p.add_argument("--nodes", type=Path, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument(
        "--pods", type=Path, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...])"
    )
    p.add_argument("--policy", default="all", help=f"one of {', '.join(POLICIES)}, or 'all' (default)")
    p.add_argument("--seed", type=int, default=42, help="arrival order seed (default 42)")
    p.add_argument("--event-order", type=Path, help="replay a published run's pod order and node tie-breaks")
    p.add_argument("--json", type=Path, help="write the report(s) as JSON")
    p.add_argument("--plot", type=Path, help="write the allocation curves as a PNG")
    p.add_argument("--ratio", type=float, default=1.3, help="arrivals up to this multiple of GPU capacity")
    p.set_defaults(func=run)


def _progress(stack: ExitStack) -> Callable[[str, int], Callable[[int], None]] | None:
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = stack.enter_context(
        Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
    )

    def for_policy(name: str, total: int) -> Callable[[int], None]:
        task = bar.add_task(name, total=total)
        return lambda n: bar.advance(task, n)

    return for_policy


def run(args: argparse.Namespace) -> int:
    names = list(POLICIES) if args.policy == "all" else [args.policy]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise UserError(f"unknown policy {unknown[0]!r}; choose one of: {', '.join(POLICIES)}, all")
    if (args.nodes is None) != (args.pods is None):
        raise UserError("give both --nodes and --pods, or neither (the bundled openb default trace)")
    if not 0 < args.ratio <= 10:
        raise UserError(f"--ratio must be in (0, 10], got {args.ratio}")
    try:
        trace = read_trace(args.nodes, args.pods)
        workload = prepare_workload(trace, args.seed, args.event_order, args.ratio)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    for warning in trace.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    with ExitStack() as stack:
        reports = simulate(trace, workload, names, _progress(stack))
    from rich.console import Console

    from gpupool_sched.simulate.report import render_table

    Console(width=None if sys.stdout.isatty() else 110).print(render_table(reports))
    if args.json:
        payload = reports[0].model_dump() if len(reports) == 1 else [r.model_dump() for r in reports]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"JSON report: {args.json}")
    if args.plot:
        from gpupool_sched.simulate.plot import plot_reports

        plot_reports(reports, args.plot)
        print(f"plot: {args.plot}")
    return 0
