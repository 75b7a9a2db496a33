"""The time simulator's speed (`gpupool simulate --mode time`): events per second on the bundled openb default
trace (6,212 GPUs), per load, on one core, and whether two runs with one seed give the same report.

For each load: the pre-fill, then --days of simulated time; events = arrivals + departures + give-ups
(pre-fill placements not counted); the wall time of the event loop, the share of it in the placement core
(Cycle's decide and preemption planning), and the wall time 7 simulated days would take at that rate.
JSON + markdown table in --out (time.json, time.md); --profile also writes cProfile's top functions.

    python -m benchmarks.bench_time --loads 0.8,1.0,1.2 --days 0.25   # what make bench-time runs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.simulate.timerun import DAY_S, TimeSettings, run_load, trace_pods, workload_profile
from gpupool_sched.simulate.trace import read_trace

TARGET_EVENTS, TARGET_SECONDS = 100_000, 60.0  # issue 21: >= 100k events in <= 60 s on one core


def measure(load: float, days: float, seed: int, defrag: bool = False) -> dict:
    trace = read_trace()
    settings = TimeSettings((load,), days * DAY_S, seed=seed, defrag=DefragConfig(enabled=defrag))
    pods = trace_pods(trace, None, settings)
    start = time.perf_counter()
    report = run_load(trace, pods, workload_profile(trace), settings, load)
    total = time.perf_counter() - start
    s = report.stats
    rate = s.events / s.seconds if s.seconds else 0.0
    return {
        "load": load, "days": days, "seed": seed, "events": s.events, "arrivals": s.arrivals,
        "preemptions": s.preemptions, "prefilled": s.prefilled, "loop_seconds": round(s.seconds, 2),
        "prefill_seconds": round(total - s.seconds, 2), "placement_seconds": round(s.cycle_seconds, 2),
        "events_per_s": round(rate, 1), "seconds_for_7_days": round(s.seconds * 7 / days, 1),
        "seconds_for_100k_events": round(TARGET_EVENTS / rate, 1) if rate else None,
        "allocated_pct": round(report.allocated_pct, 2),
    }


def deterministic(load: float, days: float, seed: int, defrag: bool = False) -> bool:
    trace = read_trace()
    settings = TimeSettings((load,), days * DAY_S, seed=seed, defrag=DefragConfig(enabled=defrag))
    pods = trace_pods(trace, None, settings)
    profile = workload_profile(trace)
    runs = []
    for _ in range(2):
        out = run_load(trace, pods, profile, settings, load).json()
        out.pop("seconds")
        out.pop("placement_seconds")
        runs.append(out)
    return runs[0] == runs[1]


def markdown(rows: list[dict], same: bool) -> str:
    lines = ["| load | simulated days | events | preemptions | loop s | placement core s | events/s | "
             "s for 100k events | s for 7 days |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['load']:g} | {r['days']:g} | {r['events']} | {r['preemptions']} | {r['loop_seconds']} | "
                     f"{r['placement_seconds']} | {r['events_per_s']} | {r['seconds_for_100k_events']} | "
                     f"{r['seconds_for_7_days']} |")
    lines.append("")
    lines.append(f"target: {TARGET_EVENTS} events in <= {TARGET_SECONDS:g} s; same seed, same report: {same}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.8,1.0,1.2")
    ap.add_argument("--days", type=float, default=0.25, help="simulated days per load")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    ap.add_argument("--profile", action="store_true", help="also write cProfile's top 30 (time_profile.txt)")
    ap.add_argument("--defrag", choices=("on", "off"), default="off",
                    help="run the consolidate action (simulate's default is on; its cost is not tuned yet, so the "
                    "speed target is measured without it, default off)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        if args.profile:
            profiler = cProfile.Profile()
            row = profiler.runcall(measure, load, args.days, args.seed, args.defrag == "on")
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
            (args.out / f"time_profile_{load:g}.txt").write_text(text.getvalue())
        else:
            row = measure(load, args.days, args.seed, args.defrag == "on")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    same = deterministic(1.0, 0.01, args.seed, args.defrag == "on")
    (args.out / "time.json").write_text(json.dumps({"runs": rows, "deterministic": same,
                                                    "target": {"events": TARGET_EVENTS, "seconds": TARGET_SECONDS}},
                                                   indent=1) + "\n")
    (args.out / "time.md").write_text(markdown(rows, same))
    print(markdown(rows, same))
    print(f"JSON/markdown in {args.out}/time.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
