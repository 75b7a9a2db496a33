"""Faithfulness and quality on the FGD paper's published runs (../shared/traces/openb).

For each trace and seed, replays the published event order (pod order, sampled copies, node
tie-break names) with the chosen policies and compares the allocated GPU % at 100% arrived with the
paper's artifact (paper_alloc.csv). Writes JSON, a markdown table (for docs/) and a PNG.

    python -m benchmarks.bench_faithfulness --policies fgd,best-fit,gpupool --seeds 42-51
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.openb import ALL_TRACES, DEFAULT_TRACES, PAPER_LABEL, Run, paper_values, replay_published


def _one(job: tuple[str, str, int, str]) -> Run:
    trace, policy, seed, root = job
    return replay_published(trace, policy, seed, Path(root))


def run_jobs(traces: list[str], policies: list[str], seeds: list[int], root: Path, workers: int) -> list[Run]:
    jobs = [(t, p, s, str(root)) for t in traces for s in seeds for p in policies]
    runs: list[Run] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for i, run in enumerate(pool.map(_one, jobs), start=1):
            runs.append(run)
            print(
                f"[{i}/{len(jobs)}] {run.trace:12s} {run.policy:9s} seed {run.seed}: {run.alloc_at_100:6.2f}%"
                f" ({run.seconds:.1f}s)",
                file=sys.stderr,
                flush=True,
            )
    return runs


def summarize(runs: list[Run], paper: dict) -> dict:
    rows: dict[str, dict] = {}
    by_key = {(r.trace, r.policy, r.seed): r for r in runs}
    for r in runs:
        row = rows.setdefault(f"{r.trace}/{r.policy}", {"trace": r.trace, "policy": r.policy, "seeds": {}})
        ref = paper.get((r.trace, PAPER_LABEL.get(r.policy, r.policy), r.seed))
        entry = {"ours_100": r.alloc_at_100, "ours_130": r.alloc_at_130, "seconds": r.seconds}
        if ref:
            entry |= {"paper_100": ref[0], "paper_130": ref[1], "diff_100": round(r.alloc_at_100 - ref[0], 2)}
        fgd = by_key.get((r.trace, "fgd", r.seed))
        if fgd and r.policy != "fgd":
            entry["unallocated_vs_fgd"] = round((100 - r.alloc_at_100) / (100 - fgd.alloc_at_100), 3)
        row["seeds"][r.seed] = entry
    for row in rows.values():
        seeds = row["seeds"].values()
        diffs = [abs(e["diff_100"]) for e in seeds if "diff_100" in e]
        row["mean_100"] = round(sum(e["ours_100"] for e in seeds) / len(seeds), 2)
        if diffs:
            row["max_abs_diff_100"] = max(diffs)
        ratios = [e["unallocated_vs_fgd"] for e in seeds if "unallocated_vs_fgd" in e]
        if ratios:
            row["mean_unallocated_vs_fgd"] = round(sum(ratios) / len(ratios), 3)
            row["max_unallocated_vs_fgd"] = max(ratios)
    return rows


def markdown(rows: dict) -> str:
    lines = [
        "| trace | policy | mean allocated % at 100% | max abs diff vs paper (pts)"
        " | unallocated vs FGD (mean / worst) |",
        "|---|---|---|---|---|",
    ]
    for row in rows.values():
        diff = f"{row['max_abs_diff_100']:.2f}" if "max_abs_diff_100" in row else "n/a"
        ratio = (
            f"{row['mean_unallocated_vs_fgd']:.3f} / {row['max_unallocated_vs_fgd']:.3f}"
            if "mean_unallocated_vs_fgd" in row
            else ""
        )
        lines.append(f"| {row['trace']} | {row['policy']} | {row['mean_100']:.2f} | {diff} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in rows.values()}, key=lambda t: ALL_TRACES.index(t) if t in ALL_TRACES else 99)
    policies = sorted({r["policy"] for r in rows.values()})
    fig, ax = plt.subplots(figsize=(max(8, len(traces) * 0.9), 4.5))
    width = 0.8 / len(policies)
    for k, policy in enumerate(policies):
        values = [100 - rows[f"{t}/{policy}"]["mean_100"] if f"{t}/{policy}" in rows else 0 for t in traces]
        ax.bar([i + k * width for i in range(len(traces))], values, width, label=policy)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(traces))], traces, rotation=45, ha="right")
    ax.set_ylabel("unallocated GPUs at 100% arrived (%)")
    ax.set_title("openb traces, published event orders (mean over seeds)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(ALL_TRACES))
    ap.add_argument("--policies", default="fgd,best-fit,gpupool")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--root", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    runs = run_jobs(args.traces.split(","), args.policies.split(","), seeds, args.root, args.workers)
    rows = summarize(runs, paper_values(args.root))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faithfulness.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "faithfulness.md").write_text(markdown(rows))
    plot(rows, args.out / "faithfulness.png")
    print(markdown(rows))
    print(f"JSON/markdown/PNG in {args.out}/faithfulness.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
