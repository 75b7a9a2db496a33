"""The scheduler on a cluster, this tree against a baseline commit (an A/B, not a test).

`bench_cluster` runs once per side and round, gpupool only, the sides alternated (A B, then B A, ...)
so that neither always meets the warmer machine; each run brings up its own cluster of the same size.
Both sides are checked out with `git worktree` (the candidate defaults to HEAD: edits made in the tree
while it runs do not leak in) and their schedulers started from there (`bench_cluster --gpupool-src`);
the benchmark code and the cluster are this tree's for both sides.

Per mode and measure it reports the median of each side's rounds, the ratio candidate / baseline and
the noise: the largest spread between two rounds of the same side (max / min - 1, over both sides).
A ratio inside 1 +- noise is no difference.

    python -m benchmarks.bench_ab --baseline 7727648 --rounds 2 --out out/bench/ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GC_PAUSES = "gpupool_scheduler_gc_pause_seconds_total{generation="
EVENTS_POSTED = "gpupool_scheduler_events_posted_total{outcome=posted,"
Measure = tuple[str, ...] | Callable[[dict[str, Any]], float]
MEASURES: dict[str, tuple[Measure, bool]] = {  # name -> (path into a bench_cluster run, or a function of
    # the run; higher is better)
    "pods_per_s": (("pods_per_s",), True),
    "p50_ms": (("latency_ms", "p50"), False),
    "p99_ms": (("latency_ms", "p99"), False),
    "rss_peak_mib": (("rss_peak_mib",), False),
    "cpu_s": (("cpu_s", "scheduler"), False),
    "main_thread_cpu_s": (("cpu_s", "scheduler_main_thread"), False),
    # the collector's pauses (all generations) and the Events posted: a CPU difference between the sides may
    # be garbage collection, or one side posting more of the Scheduled Events the other dropped
    "gc_s": (lambda run: sum(v for k, v in run.get("metrics", {}).items() if k.startswith(GC_PAUSES)), False),
    "events_posted": (lambda run: sum(v for k, v in run.get("metrics", {}).items()
                                      if k.startswith(EVENTS_POSTED)), True),
}


def _get(run: dict[str, Any], path: Measure) -> float:
    if callable(path):
        return float(path(run))
    value: Any = run
    for key in path:
        value = value.get(key, 0.0) if isinstance(value, dict) else 0.0
    return float(value)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """runs: side ("baseline"/"candidate") -> bench_cluster runs of every round. Per mode and measure:
    each side's median and rounds, candidate / baseline, and the noise of the two sides' rounds."""
    out: dict[str, Any] = {}
    modes = sorted({r["mode"] for side in runs.values() for r in side})
    for mode in modes:
        per: dict[str, Any] = {}
        for measure, (path, _) in MEASURES.items():
            values = {side: [_get(r, path) for r in rs if r["mode"] == mode] for side, rs in runs.items()}
            if not all(values.values()) or not any(x for v in values.values() for x in v):
                continue
            median = {side: statistics.median(v) for side, v in values.items()}
            spread = max((max(v) / min(v) - 1) if min(v) > 0 else 0.0 for v in values.values())
            base = median["baseline"]
            per[measure] = {
                "baseline": round(base, 2), "candidate": round(median["candidate"], 2),
                "ratio": round(median["candidate"] / base, 3) if base else None,
                "noise": round(spread, 3), "rounds": {side: [round(x, 2) for x in v] for side, v in values.items()},
            }
        out[mode] = per
    return out


def markdown(summary: dict[str, Any], baseline: str, candidate: str) -> str:
    lines = [f"candidate `{candidate}` against baseline `{baseline}` (medians of the rounds; "
             "ratio = candidate / baseline; noise = largest spread between rounds of one side)", "",
             "| mode | measure | baseline | candidate | ratio | noise |", "|---|---|---|---|---|---|"]
    for mode, per in summary.items():
        for measure, m in per.items():
            lines.append(f"| {mode} | {measure} | {m['baseline']} | {m['candidate']} | x{m['ratio']} | "
                         f"±{m['noise'] * 100:.0f}% |")
    return "\n".join(lines) + "\n"


def _rev(ref: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare against")
    parser.add_argument("--candidate", default="HEAD", help="git revision to measure (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side")
    parser.add_argument("--out", type=Path, default=Path("out/bench/ab"))
    parser.add_argument("cluster_args", nargs="*", help="passed to bench_cluster (after --), e.g. "
                        "--modes stream,backlog,paced --nodes 1000")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    baseline, candidate = _rev(args.baseline), _rev(args.candidate)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "candidate": []}
    with tempfile.TemporaryDirectory(prefix="gpupool-ab-") as tmp:
        trees = {side: Path(tmp) / side for side in ("baseline", "candidate")}
        for side, rev in (("baseline", baseline), ("candidate", candidate)):
            subprocess.run(["git", "worktree", "add", "--detach", "-f", str(trees[side]), rev], cwd=ROOT,
                           check=True, capture_output=True)
        try:
            sources = {side: tree / "src" for side, tree in trees.items()}
            for r in range(args.rounds):
                for side in ("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline"):
                    folder = args.out / f"{side}-{r + 1}"
                    began = time.monotonic()
                    print(f"round {r + 1}/{args.rounds}: {side} ({sources[side]}) ...", file=sys.stderr, flush=True)
                    subprocess.run([sys.executable, "-m", "benchmarks.bench_cluster", "--skip-kube-scheduler",
                                    "--decision-sizes", "", "--gpupool-src", str(sources[side]),
                                    "--out", str(folder), *args.cluster_args], cwd=ROOT, check=True)
                    report = json.loads((folder / "cluster.json").read_text())
                    runs[side].extend(report["runs"])
                    print(f"round {r + 1}/{args.rounds}: {side} done in {time.monotonic() - began:.0f}s",
                          file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    summary = summarise(runs)
    (args.out / "ab.json").write_text(json.dumps(
        {"baseline": baseline, "candidate": candidate, "rounds": args.rounds, "cluster_args": args.cluster_args,
         "summary": summary}, indent=1) + "\n")
    text = markdown(summary, baseline, candidate)
    (args.out / "ab.md").write_text(text)
    print(text)
    print(f"wrote {args.out}/ab.json, ab.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
