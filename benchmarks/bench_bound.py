"""The lower bound on unallocated GPUs (simulate/bound.py) per openb trace, beside FGD and gpupool.

For each trace and seed (the published runs' pod orders, as bench_faithfulness replays them): the bound, its
wall time, and, for the seeds in --replay-seeds, FGD's and gpupool's unallocated GPU % at 100% arrived and the
share of FGD's gap to the bound that gpupool closes, (FGD - gpupool) / (FGD - bound). JSON + markdown table in
--out (bound.json, bound.md).

    python -m benchmarks.bench_bound --seeds 42-51 --replay-seeds 42-51
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.openb import ALL_TRACES, DEFAULT_TRACES, load
from gpupool_sched.simulate.run import bound_report, prepare_workload, simulate

POLICIES = ("fgd", "gpupool")


def _seeds(text: str) -> list[int]:
    if not text:
        return []
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def one(job: tuple[str, int, bool, str]) -> dict:
    trace, seed, replay, root = job
    t = load(trace, Path(root))
    order = Path(root) / "sim_event_order" / f"openb_pod_list_{trace}.order.csv.gz"
    workload = prepare_workload(t, seed, order)
    b = bound_report(t, workload)
    row: dict = {"trace": trace, "seed": seed, "bound": b.unallocated_pct, "bound_seconds": b.seconds,
                 "pattern_lp_converged": b.pattern_lp_converged}
    if replay:
        for report in simulate(t, workload, list(POLICIES)):
            row[report.policy] = report.final.unallocated_pct
        gap = row["fgd"] - row["bound"]
        row["closed"] = round((row["fgd"] - row["gpupool"]) / gap, 3) if gap > 0 else None
    return row


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        both = [r for r in mine if "fgd" in r]
        mean = lambda key, rs: round(sum(r[key] for r in rs) / len(rs), 2) if rs else None  # noqa: E731
        entry = {
            "trace": trace,
            "seeds": len(mine),
            "bound": mean("bound", mine),
            "bound_seconds_max": max(r["bound_seconds"] for r in mine),
            "replayed_seeds": len(both),
            "bound_replayed": mean("bound", both),
            "fgd": mean("fgd", both),
            "gpupool": mean("gpupool", both),
        }
        if both and entry["fgd"] - entry["bound_replayed"] > 0:
            entry["closed"] = round((entry["fgd"] - entry["gpupool"]) / (entry["fgd"] - entry["bound_replayed"]), 3)
        out.append(entry)
    return out


def markdown(summary: list[dict]) -> str:
    lines = [
        "| trace | bound, unallocated % (mean, seeds) | max bound s | FGD % | gpupool % | bound % (same seeds)"
        " | gap closed (FGD - gpupool) / (FGD - bound) |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        closed = f"{100 * e['closed']:.0f}%" if "closed" in e else ""
        lines.append(
            f"| {e['trace']} | {f(e['bound'])} ({e['seeds']}) | {e['bound_seconds_max']:.2f} | {f(e['fgd'])} | "
            f"{f(e['gpupool'])} | {f(e['bound_replayed'])} ({e['replayed_seeds']}) | {closed} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(ALL_TRACES))
    ap.add_argument("--seeds", default="42-51", help="seeds to bound")
    ap.add_argument("--replay-seeds", default="42-51", help="of those, the seeds to replay FGD and gpupool on")
    ap.add_argument("--root", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args(argv)
    replay = set(_seeds(args.replay_seeds))
    jobs = [(t, s, s in replay, str(args.root)) for t in args.traces.split(",") for s in _seeds(args.seeds)]
    rows = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, row in enumerate(pool.map(one, jobs), start=1):
            rows.append(row)
            print(f"[{i}/{len(jobs)}] {json.dumps(row)}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bound.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1) + "\n")
    (args.out / "bound.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"JSON/markdown in {args.out}/bound.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
