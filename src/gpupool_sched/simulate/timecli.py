"""`gpupool simulate --mode time`: its flags, their checks, and the run (table, JSON, plot)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool_sched.errors import UserError
from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate.outputs import write_outputs

if TYPE_CHECKING:
    from gpupool_sched.framework.plugins.defrag_config import DefragConfig
    from gpupool_sched.simulate.timegangs import GangSpec

MODES = ("arrivals", "time")
MAX_DAYS = 365.0
MAX_PATIENCE_S = 10**8
DEFAULT_LOADS = "0.8,1.0,1.2"
TIME_FLAGS = ("load", "days", "horizon", "patience", "defrag_after", "defrag_budget", "gangs")


def add_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "time mode",
        "--mode time: pods arrive as a seeded Poisson stream offering --load x the GPU capacity, run their "
        "trace lifetime and leave; a pod that does not fit waits (and may preempt) until its patience runs out. "
        "Decisions are the scheduler service's (Cycle over ClusterState). docs/simulator.md, 'Time mode'.",
    )
    group.add_argument("--mode", choices=MODES, default="arrivals",
                       help="arrivals: the FGD paper's replay (default); time: the simulator in time")
    group.add_argument("--load", metavar="RHO[,RHO...]",
                       help="offered GPU load(s), a share of capacity in (0, 10]; one run each "
                       f"(default {DEFAULT_LOADS})")
    group.add_argument("--days", type=float, metavar="DAYS", help="simulated days measured per load (default 1)")
    group.add_argument("--horizon", type=float, metavar="DAYS",
                       help="lifetimes are capped at this many days; also the pre-fill's look-back (default 7)")
    group.add_argument("--patience", type=float, metavar="SECONDS",
                       help="how long a waiting pod stays at least, when its trace does not say it gave up "
                       "sooner (default 3600)")
    # --defrag itself (on by default, as the scheduler's) is shared with --from-cluster (whatif.py)
    group.add_argument("--defrag-after", type=float, metavar="SECONDS",
                       help="with --defrag on: a pod waits this long before pods move for it (default 60, the "
                       "scheduler's --defrag-after)")
    group.add_argument("--defrag-budget", type=int, metavar="MOVES",
                       help="with --defrag on: moves per hour cluster-wide (default 1 %% of the running GPU pods, at "
                       "least 1, as the scheduler's --defrag-budget)")
    group.add_argument("--gangs", metavar="SHARE:SIZE",
                       help="SHARE (0..1] of the arrivals asking for 2 or more GPUs arrive as a gang of SIZE such "
                       "pods (a PodGroup, minMember SIZE: placed all together or not at all, leaving together); "
                       "the offered load stays --load (default: no gangs)")


def parse_loads(value: str) -> tuple[float, ...]:
    loads: list[float] = []
    for item in (part.strip() for part in value.split(",")):
        try:
            load = float(item)
        except ValueError:
            raise UserError(f"--load {value!r}: {item!r} is not a number") from None
        if not (math.isfinite(load) and 0 < load <= 10):
            raise UserError(f"--load {value!r}: each load must be in (0, 10], got {item}")
        if load not in loads:
            loads.append(load)
    return tuple(loads)


def _days(flag: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if not (math.isfinite(value) and 0 < value <= MAX_DAYS):
        raise UserError(f"--{flag} must be in (0, {MAX_DAYS:g}] days, got {value:g}")
    return value


def defrag_config(args: argparse.Namespace) -> DefragConfig:
    """The consolidate action's settings: the scheduler's defaults (framework/plugins/movers.py) but for
    the two time-mode flags."""
    from gpupool_sched.framework.plugins.defrag_config import DefragConfig

    after = 60.0 if args.defrag_after is None else args.defrag_after
    if not (math.isfinite(after) and after >= 0):
        raise UserError(f"--defrag-after must be a non-negative number of seconds, got {after:g}")
    if args.defrag_budget is not None and args.defrag_budget < 0:
        raise UserError(f"--defrag-budget must not be negative, got {args.defrag_budget}")
    return DefragConfig(enabled=args.defrag == "on", after_s=after, per_hour=args.defrag_budget)


def gang_spec(args: argparse.Namespace) -> GangSpec | None:
    """--gangs SHARE:SIZE, checked (None: no gangs)."""
    if args.gangs is None:
        return None
    from gpupool_sched.simulate.timegangs import GangSpec, GangSpecError

    try:
        return GangSpec.parse(args.gangs)
    except GangSpecError as exc:
        raise UserError(str(exc)) from None


def check_time_arguments(args: argparse.Namespace) -> tuple[str, tuple[float, ...], float, float, float]:
    """(policy, loads, days, horizon days, patience s), every flag checked before any file is read; the
    arrivals replay's own flags are refused, not ignored."""
    for flag, given in (("--event-order", args.event_order is not None), ("--bound", args.bound),
                        ("--sample-percentage", args.sample_percentage is not None),
                        ("--ratio", args.ratio is not None),
                        ("--profile rolling", args.profile != "trace")):
        if given:
            raise UserError(f"{flag} is for the arrivals replay; --mode time does not take it")
    policy = args.policy.strip()
    if policy == "all":  # the replay's default: time mode runs one policy, ours
        policy = "gpupool"
    if policy not in POLICIES:
        raise UserError(f"--mode time runs one policy; --policy {policy!r} is not one of: {', '.join(POLICIES)}")
    loads = parse_loads(args.load if args.load is not None else DEFAULT_LOADS)
    days = _days("days", args.days, 1.0)
    horizon = _days("horizon", args.horizon, 7.0)
    patience = 3600.0 if args.patience is None else args.patience
    if not (math.isfinite(patience) and 0 <= patience <= MAX_PATIENCE_S):
        raise UserError(f"--patience must be in 0..{MAX_PATIENCE_S} seconds, got {patience:g}")
    return policy, loads, days, horizon, patience


def refuse_time_flags(args: argparse.Namespace) -> None:
    """The arrivals replay refuses the time mode's flags rather than ignore them."""
    for name in TIME_FLAGS:
        if getattr(args, name) is not None:
            raise UserError(f"--{name.replace('_', '-')} is for --mode time (the arrivals replay has no time)")


def _progress(stack: ExitStack, days: float) -> Callable[[str], Callable[[float], None]] | None:
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = stack.enter_context(Progress(TextColumn("{task.description:<12}"), BarColumn(),
                                       TextColumn("{task.completed:.2f}/{task.total:.2f} days"),
                                       TimeElapsedColumn(), console=Console(stderr=True)))

    def for_load(name: str) -> Callable[[float], None]:
        task = bar.add_task(name, total=days)
        return lambda at: bar.update(task, completed=at / 86400)

    return for_load


def run_time_mode(args: argparse.Namespace) -> int:
    from gpupool_sched.simulate.cli import check_output, check_plot_format
    from gpupool_sched.simulate.timerun import DAY_S, TimeSettings, run_load, trace_pods, workload_profile
    from gpupool_sched.simulate.trace import TraceError, read_trace

    policy, loads, days, horizon, patience = check_time_arguments(args)
    if not 0 <= args.seed <= 2**63 - 1:
        raise UserError(f"--seed must be in 0..{2**63 - 1}, got {args.seed}")
    if args.json:
        check_output("--json", args.json)
    if args.plot:
        check_plot_format(args.plot)
        check_output("--plot", args.plot)
    if (args.nodes is None) != (args.pods is None):
        raise UserError("give both --nodes and --pods, or neither (the bundled openb default trace)")
    settings = TimeSettings(loads, days * DAY_S, horizon * DAY_S, patience, args.seed, policy,
                            samples=200 if args.plot else 0, defrag=defrag_config(args), gangs=gang_spec(args))
    try:
        trace = read_trace(args.nodes, args.pods, extra_models=args.gpu_model)
        pods = trace_pods(trace, args.pods, settings)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    for warning in trace.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    profile = workload_profile(trace)
    reports = []
    with ExitStack() as stack:
        progress = _progress(stack, days)
        for load in loads:
            reports.append(run_load(trace, pods, profile, settings, load,
                                    progress(f"load {load:g}") if progress else None))
    from rich.console import Console

    from gpupool_sched.simulate.timereport import render_time_tables

    console = Console(width=None if sys.stdout.isatty() else 120)
    for table in render_time_tables(reports):
        console.print(table)

    def draw(path: Path) -> None:
        from gpupool_sched.simulate.timereport import plot_time

        plot_time(reports, path)

    write_outputs(args.json, lambda: [r.json() for r in reports], args.plot, draw)
    return 0
