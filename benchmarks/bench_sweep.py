"""Wall time of `gpupool simulate sweep` on a subset of the paper grid, locally and on a local Ray head, and
the projected wall time of the whole grid (17 openb traces x 10 seeds x 7 policies = 1190 runs).

Method: the subset (--traces, --seeds, every policy, ratio 1.3 as the paper) is swept twice into fresh
directories, once in --workers local processes and once as Ray tasks on a private head on 127.0.0.1 with
--workers CPUs (skipped when Ray is not installed). Each run's own wall time (timing/<key>.json) gives the
mean seconds per run of each policy over the subset's traces; the grid's serial time is 17 x 10 x the sum
of those means (the openb traces share one node list and have pod lists of similar size: an estimate,
not a measurement). Projected wall time on N CPUs = serial / (N x efficiency), where efficiency = (sum of
the runs' seconds) / (wall x workers) as measured locally, and never below the slowest single run.
JSON + markdown table in --out (sweep.json, sweep.md).

    python -m benchmarks.bench_sweep --traces default,gpushare40,multigpu50 --seeds 1 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.openb import ALL_TRACES, DEFAULT_TRACES
from gpupool_sched.cli import version
from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate.sweep import Backend, LocalProcesses, SweepOutcome, run_sweep
from gpupool_sched.simulate.sweep_grid import load_grid

PAPER_TRACES, PAPER_SEEDS = len(ALL_TRACES), 10
PROJECT_CPUS = (2, 16, 128)


def sweep_once(grid: Path, traces_dir: Path, backend: Backend) -> tuple[float, SweepOutcome]:
    runs = load_grid(grid, traces_dir, version()).runs
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as out:
        start = time.perf_counter()
        outcome = run_sweep(runs, Path(out), backend)
        return time.perf_counter() - start, outcome


def on_ray(grid: Path, traces_dir: Path, cpus: int) -> tuple[float, SweepOutcome] | None:
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        print("ray is not installed: no Ray measurement (pip install 'gpupool[ray]')", file=sys.stderr)
        return None
    from gpupool_sched.simulate.sweep_ray import RayCluster
    from tests.support.ray_head import ray_head

    with ray_head(num_cpus=cpus) as address:
        return sweep_once(grid, traces_dir, RayCluster(address))


def per_policy_seconds(outcome: SweepOutcome) -> dict[str, float]:
    by_policy: dict[str, list[float]] = {}
    for key, data in outcome.results.items():
        by_policy.setdefault(data["config"]["policy"], []).append(outcome.seconds[key])
    return {p: round(statistics.fmean(v), 3) for p, v in by_policy.items()}


def project(outcome: SweepOutcome, wall: float, workers: int) -> dict[str, Any]:
    means = per_policy_seconds(outcome)
    busy = sum(outcome.seconds.values())
    efficiency = min(1.0, busy / (wall * workers))
    serial = PAPER_TRACES * PAPER_SEEDS * sum(means.values())
    slowest = max(outcome.seconds.values())
    return {
        "runs": PAPER_TRACES * PAPER_SEEDS * len(means),
        "seconds_per_run_by_policy": means,
        "efficiency": round(efficiency, 3),
        "serial_seconds": round(serial, 1),
        "wall_seconds_on": {str(n): round(max(serial / (n * efficiency), slowest), 1) for n in PROJECT_CPUS},
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"subset: {result['subset_runs']} runs ({', '.join(result['traces'])} x seeds {result['seeds']} x "
        f"{len(POLICIES)} policies), {result['workers']} workers on a {result['cpus']}-CPU machine",
        "",
        "| backend | wall s | sum of run s | runs/s |",
        "|---|---:|---:|---:|",
    ]
    for name in ("local", "ray"):
        m = result.get(name)
        if m:
            lines.append(f"| {name} | {m['wall_seconds']} | {m['run_seconds']} | {m['runs_per_second']} |")
    p = result["projection"]
    lines += ["", f"paper grid ({p['runs']} runs), projected from the local subset (efficiency "
              f"{p['efficiency']}): serial {p['serial_seconds']} s", "",
              "| CPUs | wall s | wall h |", "|---:|---:|---:|"]
    for n, s in p["wall_seconds_on"].items():
        lines.append(f"| {n} | {s} | {s / 3600:.2f} |")
    lines += ["", "| policy | s per run |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in p["seconds_per_run_by_policy"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="default,gpushare40,multigpu50")
    parser.add_argument("--seeds", default="1", help="comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    args = parser.parse_args(argv)
    traces = args.traces.split(",")
    if any(t != "default" for t in traces) and not args.traces_dir.is_dir():
        print(f"bench_sweep: no openb traces at {args.traces_dir} (set GPUPOOL_OPENB)", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-sweep-grid-") as tmp:
        grid = Path(tmp) / "grid.yaml"
        grid.write_text(yaml.safe_dump({"traces": traces, "seeds": seeds, "policies": "all",
                                        "parameters": {"ratio": 1.3}}))
        result: dict[str, Any] = {"traces": traces, "seeds": seeds, "workers": args.workers,
                                  "cpus": os.cpu_count(), "gpupool_version": version()}
        for name, measure in (("local", lambda: sweep_once(grid, args.traces_dir, LocalProcesses(args.workers))),
                              ("ray", lambda: None if args.no_ray else on_ray(grid, args.traces_dir, args.workers))):
            print(f"bench_sweep: {name} ...", file=sys.stderr, flush=True)
            measured = measure()
            if measured is None:
                continue
            wall, outcome = measured
            result["subset_runs"] = outcome.total
            result[name] = {"wall_seconds": round(wall, 2), "run_seconds": round(sum(outcome.seconds.values()), 2),
                            "runs_per_second": round(outcome.ran / wall, 3)}
            if name == "local":
                result["projection"] = project(outcome, wall, args.workers)
    (args.out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / "sweep.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
