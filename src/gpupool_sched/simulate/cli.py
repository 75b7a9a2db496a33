"""`gpupool simulate`: replay a cluster trace through placement policies."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from gpupool_sched.errors import UserError
from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate import timecli, whatif
from gpupool_sched.simulate.arrivals import DEFAULT_RATIO
from gpupool_sched.simulate.outputs import write_outputs
from gpupool_sched.simulate.run import PROFILE_SOURCES, prepare_workload, simulate
from gpupool_sched.simulate.trace import KNOWN_GPU_MODELS, TraceError, read_trace

MAX_SEED = 2**63 - 1  # numpy takes any non-negative seed; JSON readers take int64
EPILOG = (
    "The table reports the cluster when arrivals reach 100% of its GPU capacity: allocated, unallocated and "
    "fragmented GPU capacity, and 'failed pods', the arrivals that found no node with room by then (a failed pod "
    "is never retried). When no arrival lands within 1 point of 100% (one pod jumps over it, as on a small "
    "trace) or the arrivals end short of it (--ratio below 1), the numbers are measured at the first arrival "
    "past 100% or at the last arrival instead: an 'arrived %' column says where and a warning says why. "
    "The JSON adds failed_pods_total, the failed arrivals of the whole replay (up to --ratio "
    "x capacity), and final.failed_pods, the table's number. Bad input (files, flags, output paths) stops "
    "before the replay with one line naming the file, line and field, and exit code 2."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a GPU cluster trace through placement policies (FGD paper method)",
        description=(
            "Replay Alibaba cluster-trace-gpu-v2023 style node and pod lists (the bundled openb default "
            "trace when --nodes/--pods are omitted): pods arrive in a seeded order, copies are sampled up to "
            "130% of GPU capacity, nothing leaves and failed pods are not retried."
        ),
        epilog=EPILOG,
    )
    p.add_argument("--nodes", type=Path, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument(
        "--pods", type=Path, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...])"
    )
    p.add_argument(
        "--policy",
        default="all",
        help=f"one of {', '.join(POLICIES)}, or 'all' (default); several as a comma-separated list (fgd,gpupool); "
        "--mode time runs one policy, gpupool for 'all'; "
        "'none' with --bound: only the bound",
    )
    p.add_argument("--seed", type=int, default=42, help=f"arrival order seed, 0..{MAX_SEED} (default 42)")
    p.add_argument("--event-order", type=Path, help="replay a published run's pod order and node tie-breaks")
    p.add_argument("--json", type=Path, help="write the report(s) as JSON (its directory must exist)")
    p.add_argument(
        "--plot",
        type=Path,
        help="write the allocation curves as an image; the suffix picks the format (.png, .svg, .pdf, ...)",
    )
    p.add_argument(
        "--gpu-model",
        action="append",
        default=[],
        metavar="NAME",
        help="accept this GPU model on nodes besides the known ones (repeatable); known: "
        + ", ".join(sorted(KNOWN_GPU_MODELS)),
    )
    p.add_argument(
        "--bound",
        action="store_true",
        help="also print a lower bound on the unallocated GPUs at 100%% arrived that no policy can beat "
        "(an LP relaxation solved with HiGHS; docs/simulator.md, 'A lower bound'); with --policy none, "
        "only the bound",
    )
    p.add_argument("--ratio", type=float, default=None,
                   help=f"arrivals up to this multiple of GPU capacity, in (0, 10] (default: {DEFAULT_RATIO:g})")
    p.add_argument(
        "--sample-percentage",
        type=int,
        metavar="PCT",
        help="score only PCT%% of the feasible nodes, as kube-scheduler's percentageOfNodesToScore "
        "(0 = its adaptive default; omitted: score every feasible node)",
    )
    p.add_argument(
        "--sample-scan",
        choices=("fixed", "rotating"),
        default="fixed",
        help="with --sample-percentage: take the first feasible nodes in tie-break order (fixed, default) or "
        "go on from where the previous decision stopped, as kube-scheduler does (rotating)",
    )
    p.add_argument(
        "--profile",
        choices=PROFILE_SOURCES,
        default="trace",
        help="FGD's workload profile: the trace's pod mix (default) or, as the scheduler does, "
        "a rolling window of the pods arrived so far",
    )
    timecli.add_flags(p)
    whatif.add_arguments(p)
    p.set_defaults(func=run)
    from gpupool_sched.simulate.sweep_cli import register_sweep

    register_sweep(p)


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


def policy_names(value: str) -> list[str]:
    """``--policy``: one name, ``all``, or a comma-separated list of them (order kept, repeats dropped);
    ``none`` (only with --bound) runs no policy."""
    if value.strip() == "none":
        return []
    names: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            raise UserError(f"--policy {value!r}: empty name in the list")
        for name in POLICIES if item == "all" else (item,):
            if name not in POLICIES:
                raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}, all")
            if name not in names:
                names.append(name)
    return names


def check_output(flag: str, path: Path) -> None:
    """Fail before the replay, not after it, when an output file cannot be written; never create its
    directory (a typo in it would otherwise go unnoticed)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    if not parent.is_dir():
        why = "does not exist" if not parent.exists() else "is not a directory"
        raise UserError(f"{flag} {path}: directory {parent} {why}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path}: file is not writable")
    try:  # os.access answers yes to root even on a read-only file system: try it
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write in {parent}: {exc.strerror or exc}") from None


def check_plot_format(path: Path) -> None:
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ModuleNotFoundError:
        raise UserError(f"--plot {path}: needs matplotlib (the 'scheduler' extra): "
                        "pip install 'gpupool[scheduler]'") from None

    # pgf needs a LaTeX installation at save time, that is after the whole replay: not offered
    formats = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in formats:
        got = f"format {suffix!r}" if suffix else "no file suffix"
        raise UserError(f"--plot {path}: {got}; use one of .{', .'.join(formats)}")


def check_arguments(args: argparse.Namespace) -> list[str]:
    """Every flag checked, and the policies to run, before any file is read."""
    names = policy_names(args.policy)
    if not names and not args.bound:
        raise UserError("--policy none runs no policy: give --bound with it (only the bound), or name policies")
    if not names and args.plot:
        raise UserError("--plot with --policy none: there are no allocation curves to draw")
    if args.bound:
        try:
            import scipy.optimize  # noqa: F401
        except ModuleNotFoundError:
            raise UserError("--bound needs scipy (HiGHS): pip install scipy") from None
    if not 0 <= args.seed <= MAX_SEED:
        raise UserError(f"--seed must be in 0..{MAX_SEED}, got {args.seed}")
    if args.json:
        check_output("--json", args.json)
    if args.plot:
        check_plot_format(args.plot)
        check_output("--plot", args.plot)
    return names


def run(args: argparse.Namespace) -> int:
    if args.from_cluster:
        if args.mode == "time":
            raise UserError("--from-cluster decides the live cluster's pending pods once; it has no --mode time")
        return whatif.run(args)
    if args.mode == "time":
        return timecli.run_time_mode(args)
    timecli.refuse_time_flags(args)
    names = check_arguments(args)
    if (args.nodes is None) != (args.pods is None):
        raise UserError("give both --nodes and --pods, or neither (the bundled openb default trace)")
    ratio = DEFAULT_RATIO if args.ratio is None else args.ratio
    if not 0 < ratio <= 10:
        raise UserError(f"--ratio must be in (0, 10], got {ratio}")
    if args.sample_percentage is not None and not 0 <= args.sample_percentage <= 100:
        raise UserError(f"--sample-percentage must be in 0..100, got {args.sample_percentage}")
    try:
        trace = read_trace(args.nodes, args.pods, extra_models=args.gpu_model)
        workload = prepare_workload(trace, args.seed, args.event_order, ratio)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    for warning in trace.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    bound = None
    if args.bound:
        from gpupool_sched.simulate.run import bound_report

        bound = bound_report(trace, workload)
    with ExitStack() as stack:
        reports = simulate(
            trace,
            workload,
            names,
            _progress(stack),
            sample_percentage=args.sample_percentage,
            sample_rotate=args.sample_scan == "rotating",
            profile_source=args.profile,
        )
    from rich.console import Console

    from gpupool_sched.simulate.report import off_full, render_table, report_json

    for note in off_full(reports):
        print(f"warning: {note}", file=sys.stderr)
    Console(width=None if sys.stdout.isatty() else 110).print(render_table(reports, bound))
    def draw(path: Path) -> None:
        from gpupool_sched.simulate.plot import plot_reports

        plot_reports(reports, path)

    write_outputs(args.json, lambda: report_json(reports, bound), args.plot, draw)
    return 0
