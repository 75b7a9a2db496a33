"""The paper's figure: allocated GPU % against arrived workload %, one line per policy, plus the
unallocated GPUs at 100% arrived as bars."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpupool_sched.simulate.report import SimulationReport


def plot_reports(reports: Sequence[SimulationReport], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    for r in reports:
        xs = [p.arrived_pct for p in r.curve]
        ys = [p.allocated_pct for p in r.curve]
        ax.plot(xs, ys, label=r.policy, linewidth=1.6)
    ax.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=1, label="ideal")
    ax.axvline(100, color="grey", linewidth=0.8)
    first = reports[0]
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("allocated GPUs (% of capacity)")
    ax.set_title(f"{first.trace}: {first.total_gpus} GPUs, seed {first.seed}")
    ax.set_xlim(0, 130)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    inset = ax.inset_axes([0.08, 0.55, 0.38, 0.38])
    for r in reports:
        pts = [(p.arrived_pct, p.allocated_pct) for p in r.curve if p.arrived_pct >= 80]
        inset.plot([x for x, _ in pts], [y for _, y in pts], linewidth=1.2)
    inset.set_title("zoom: 80-130% arrived", fontsize=7)
    inset.tick_params(labelsize=6)
    inset.grid(alpha=0.3)

    names = [r.policy for r in reports]
    values = [r.final.unallocated_pct for r in reports]
    colors = ["tab:green" if v == min(values) else "tab:blue" for v in values]
    bars.barh(names, values, color=colors)
    for y, v in enumerate(values):
        bars.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    bars.invert_yaxis()
    at = {r.final.arrived_pct for r in reports}
    where = "100% arrived" if at == {100.0} else f"{', '.join(f'{a:g}' for a in sorted(at))}% arrived (see warning)"
    bars.set_xlabel(f"unallocated GPUs at {where} (%)")
    bars.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
