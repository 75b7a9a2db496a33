"""`gpupool simulate sweep`: run a grid of traces x seeds x parameters x policies, resumably, locally or
on Ray; a summary table and one combined JSON at the end."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpupool_sched.errors import UserError

DESCRIPTION = (
    "Run every point of a grid file (traces x seeds x parameters x policies) through the simulator, one "
    "result file per run under --out, named by a hash of the run's config, its trace files' content and the "
    "gpupool version: run again, a sweep skips the runs whose result is there. Locally in --workers "
    "processes, or on a Ray cluster with --ray (the 'ray' extra). docs/simulator.md, 'Sweeps'."
)


def register_sweep(simulate_parser: argparse.ArgumentParser) -> None:
    """`sweep` as a sub-command of `simulate`; `gpupool simulate --policy ...` (no sub-command) stays as
    it was."""
    sub = simulate_parser.add_subparsers(dest="simulate_command", metavar="{sweep}", required=False)
    p = sub.add_parser("sweep", help="run a grid of traces, seeds, parameters and policies (resumable; Ray)",
                       description=DESCRIPTION)
    p.add_argument("--grid", type=Path, required=True, help="grid file (YAML or JSON)")
    p.add_argument("--out", type=Path, default=Path("out/sweep"),
                   help="results directory: runs/<key>.json, timing/<key>.json, sweep.json (created)")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: the CPU count); ignored with --ray")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run on a Ray cluster: auto, ray://HOST:10001 or HOST:6379 (needs gpupool[ray])")
    p.add_argument("--traces-dir", type=Path,
                   help="directory of the openb traces that family names in the grid refer to (gpushare40 -> "
                   "openb_pod_list_gpushare40.csv); overrides the grid's traces_dir")
    p.set_defaults(func=run)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int, int], None] | None]:
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("runs", total=total)

        def update(done: int, skipped: int) -> None:
            bar.update(task, completed=done, description=f"runs ({skipped} done before)")

        yield update


def _unallocated(result: dict[str, Any]) -> float:
    final = result.get("final")
    return float(final["unallocated_pct"] if isinstance(final, dict) else result["unallocated_pct"])


def summary_rows(combined: dict[str, Any]) -> list[tuple[str, str, str, int, float, float, float, str]]:
    """(trace, parameters, policy, seeds, mean / min / max unallocated % at 100% arrived, mean failed
    pods) per trace, parameters and policy, in grid order."""
    rows = []
    for (trace, params, policy), results in _groups(combined, time_mode=False).items():
        values = [_unallocated(r) for r in results]
        failed = [r["final"]["failed_pods"] for r in results if "final" in r]
        rows.append((trace, params, policy, len(results), round(statistics.fmean(values), 2), min(values),
                     max(values), f"{statistics.fmean(failed):.1f}" if failed else ""))
    return rows


def _groups(combined: dict[str, Any], *, time_mode: bool) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """The results of one mode by (trace, parameters, policy), in grid order."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for item in combined["runs"]:
        if (item["result"].get("mode") == "time") != time_mode:
            continue
        c = item["config"]
        params = " ".join(f"{k}={v}" for k, v in sorted(c["parameters"].items()) if k != "mode") or "-"
        groups[(c["trace"], params, c["policy"])].append(item["result"])
    return groups


TIME_MEASURES = ("allocated_pct", "idle_gpu_hours_while_waiting", "gave_up", "preemptions", "migrations")


def time_summary_rows(combined: dict[str, Any]) -> list[tuple[str, str, str, int, list[float]]]:
    """(trace, parameters, policy, seeds, the mean of each of TIME_MEASURES) of the time-mode runs."""
    return [(trace, params, policy, len(results),
             [round(statistics.fmean(float(r[m]) for r in results), 2) for m in TIME_MEASURES])
            for (trace, params, policy), results in _groups(combined, time_mode=True).items()]


def render_time_summary(combined: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="sweep, time mode: means over the seeds",
                  caption="allocated %: time-averaged share of GPU capacity allocated; idle GPU-h waiting: free GPU "
                  "capacity integrated over the time some pod waited (docs/simulator.md, 'Time mode')",
                  caption_justify="left")
    for col in ("trace", "parameters", "policy", "seeds", "allocated %", "idle GPU-h waiting", "gave up",
                "preemptions", "migrations"):
        table.add_column(col, justify="left" if col in ("trace", "parameters", "policy") else "right")
    for trace, params, policy, n, means in time_summary_rows(combined):
        table.add_row(trace, params, policy, str(n), *(f"{v:g}" for v in means))
    return table


def render_summary(combined: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"sweep: {combined['total']} runs ({combined['skipped']} finished before, "
                  f"{combined['ran']} run now)",
                  caption="unallocated GPU capacity (%) when arrivals reach 100% of it (or where a replay short of it "
                  "ended), over the seeds; "
                  "'bound': no policy can leave less", caption_justify="left")
    for col in ("trace", "parameters", "policy", "seeds", "unallocated % mean", "min", "max", "failed pods"):
        table.add_column(col, justify="left" if col in ("trace", "parameters", "policy") else "right")
    for trace, params, policy, n, mean, lo, hi, failed in summary_rows(combined):
        table.add_row(trace, params, policy, str(n), f"{mean:.2f}", f"{lo:.2f}", f"{hi:.2f}", failed)
    return table


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is not a directory")
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
        (out / "timing").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create it: {exc.strerror or exc}") from None
    if not os.access(out / "runs", os.W_OK):
        raise UserError(f"--out {out}: not writable")


def backend_for(args: argparse.Namespace) -> Any:
    from gpupool_sched.simulate.sweep import LocalProcesses

    if args.ray is not None:
        from gpupool_sched.simulate.sweep_ray import RayCluster, import_ray

        if not args.ray.strip():
            raise UserError("--ray: empty address; give auto, ray://HOST:10001 or HOST:6379")
        import_ray()  # before any run: a missing extra is a one-line error, not a failure mid-sweep
        cluster = RayCluster(args.ray.strip())
        cluster.check_reachable()
        return cluster
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    return LocalProcesses(workers)


def run(args: argparse.Namespace) -> int:
    from gpupool_sched.cli import version
    from gpupool_sched.simulate.sweep import combined_json, run_sweep, write_atomically
    from gpupool_sched.simulate.sweep_grid import load_grid

    if args.traces_dir is not None and not args.traces_dir.is_dir():
        raise UserError(f"--traces-dir {args.traces_dir}: not a directory")
    backend = backend_for(args)
    grid = load_grid(args.grid, args.traces_dir, version())
    _check_out(args.out)
    with _progress(len(grid.runs)) as progress:
        outcome = run_sweep(grid.runs, args.out, backend, progress)
    combined = combined_json(grid.runs, outcome)
    combined["grid"] = str(args.grid)
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120)
    if any(item["result"].get("mode") != "time" for item in combined["runs"]):
        console.print(render_summary(combined))
    if any(item["result"].get("mode") == "time" for item in combined["runs"]):
        console.print(render_time_summary(combined))
    summary = args.out / "sweep.json"
    write_atomically(summary, json.dumps(combined, indent=1) + "\n")
    print(f"sweep: {outcome.total} runs, {outcome.skipped} finished before (skipped), {outcome.ran} run now; "
          f"results in {args.out / 'runs'}, combined JSON {summary}")
    return 0

