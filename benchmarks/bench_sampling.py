"""What the scheduler's shortcuts cost in allocation: scoring a sample of the feasible nodes
(kube-scheduler's percentageOfNodesToScore, placement/sampling.py) and learning FGD's workload
profile from the pods seen so far (placement/workload.py) instead of knowing the trace's.

Replays the bundled openb default trace (seeded arrivals, as `gpupool simulate`) per policy, seed
and setting, and reports the allocated GPU % at 100% arrived and its difference to the exact
setting (``all``: every feasible node scored, the trace's profile) on the same seed.

Settings: ``[rolling+](all|adaptive|pN)[-rotating]``: ``adaptive`` = percentage 0 (kube-scheduler's
50% - nodes/125), ``pN`` = N%, each scan from the first node of the tie-break order (the sampler's
default) or with ``-rotating`` from where the previous one stopped (kube-scheduler's
nextStartNodeIndex); ``rolling+`` = RollingProfile of the arrivals (``rolling`` alone: ``rolling+all``).

    python -m benchmarks.bench_sampling --out out/bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from gpupool_sched.placement.sampling import nodes_to_score
from gpupool_sched.simulate.run import ProfileSource, prepare_workload, simulate
from gpupool_sched.simulate.trace import read_trace

EXACT = "all"
DEFAULT_SETTINGS = (
    "all,adaptive,adaptive-rotating,p10,p10-rotating,p50,p50-rotating,rolling,rolling+adaptive,rolling+adaptive-rotating"
)
SETTING = re.compile(r"^(?P<rolling>rolling\+)?(?P<pct>all|adaptive|p(?P<n>\d{1,3}))(?P<rotating>-rotating)?$")


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    percentage: int | None  # None: every feasible node
    rotate: bool
    profile: ProfileSource


def parse_setting(name: str) -> Setting:
    m = SETTING.match("rolling+all" if name == "rolling" else name)
    if m is None or (m["n"] is not None and not 1 <= int(m["n"]) <= 100):
        raise ValueError(f"bad setting {name!r}: expected [rolling+](all|adaptive|pN)[-rotating], N in 1..100")
    pct = None if m["pct"] == EXACT else 0 if m["pct"] == "adaptive" else int(m["n"])
    if pct is None and m["rotating"]:
        raise ValueError(f"bad setting {name!r}: -rotating needs a sample (adaptive or pN)")
    return Setting(name, pct, bool(m["rotating"]), "rolling" if m["rolling"] else "trace")


@dataclass(frozen=True, slots=True)
class Result:
    setting: str
    policy: str
    seed: int
    allocated_pct: float
    failed_pods: int
    seconds: float


def _one(job: tuple[Setting, str, int]) -> Result:
    setting, policy, seed = job
    trace = read_trace()
    workload = prepare_workload(trace, seed)
    report = simulate(
        trace,
        workload,
        [policy],
        sample_percentage=setting.percentage,
        sample_rotate=setting.rotate,
        profile_source=setting.profile,
    )[0]
    final = report.final
    return Result(setting.name, policy, seed, final.allocated_pct, final.failed_pods, final.seconds)


def summarize(results: list[Result]) -> dict:
    exact = {(r.policy, r.seed): r.allocated_pct for r in results if r.setting == EXACT}
    rows: dict[str, dict] = {}
    for r in results:
        row = rows.setdefault(f"{r.setting}/{r.policy}", {"setting": r.setting, "policy": r.policy, "seeds": {}})
        entry: dict = {"allocated_pct": r.allocated_pct, "failed_pods": r.failed_pods, "seconds": r.seconds}
        if (r.policy, r.seed) in exact:
            entry["diff"] = round(r.allocated_pct - exact[(r.policy, r.seed)], 2)
        row["seeds"][r.seed] = entry
    for row in rows.values():
        seeds = list(row["seeds"].values())
        row["mean_pct"] = round(statistics.fmean(e["allocated_pct"] for e in seeds), 3)
        row["mean_seconds"] = round(statistics.fmean(e["seconds"] for e in seeds), 2)
        diffs = [e["diff"] for e in seeds if "diff" in e]
        if diffs:
            row["mean_diff"] = round(statistics.fmean(diffs), 3)
            row["worst_diff"] = min(diffs)
    return rows


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    seeds = result["seeds"]
    table = Table(
        title=f"allocated GPU % at 100% arrived, openb {result['trace']} ({result['nodes']} nodes: adaptive scores "
        f"{result['adaptive_nodes']}); diff = setting - all, same seed"
    )
    for col in ("setting", "policy", *(str(s) for s in seeds), "mean", "mean diff", "worst diff", "s/replay"):
        table.add_column(col, justify="left" if col in ("setting", "policy") else "right")
    for row in result["rows"].values():
        cells = [f"{row['seeds'][s]['allocated_pct']:.2f}" if s in row["seeds"] else "" for s in seeds]
        diff = f"{row['mean_diff']:+.3f}" if "mean_diff" in row else ""
        worst = f"{row['worst_diff']:+.2f}" if "worst_diff" in row else ""
        table.add_row(
            row["setting"], row["policy"], *cells, f"{row['mean_pct']:.2f}", diff, worst, f"{row['mean_seconds']:.1f}"
        )
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    ap.add_argument("--policies", default="gpupool,fgd")
    ap.add_argument("--seeds", default="42-46")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    args = ap.parse_args(argv)
    try:
        settings = [parse_setting(s) for s in args.settings.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if EXACT not in [s.name for s in settings]:
        settings.insert(0, parse_setting(EXACT))
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    policies = args.policies.split(",")
    jobs = [(s, p, seed) for s in settings for p in policies for seed in seeds]
    results: list[Result] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, r in enumerate(pool.map(_one, jobs), start=1):
            results.append(r)
            print(
                f"[{i}/{len(jobs)}] {r.setting:24s} {r.policy:8s} seed {r.seed}: {r.allocated_pct:6.2f}%"
                f" ({r.seconds:.1f}s)",
                file=sys.stderr,
                flush=True,
            )
    trace = read_trace()
    result = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "trace": trace.name,
        "nodes": len(trace.nodes),
        "adaptive_nodes": nodes_to_score(len(trace.nodes), 0),
        "seeds": seeds,
        "settings": [asdict(s) for s in settings],
        "rows": summarize(results),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "sampling.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
