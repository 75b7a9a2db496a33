"""The time mode's output: a table per run list (one row per load), a table of queueing delays per
priority, and the figure over time (allocation, queue length, fragmentation)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from gpupool_sched.simulate.timerun import TimeReport


def render_time_tables(reports: Sequence[TimeReport]) -> list[Table]:
    first = reports[0]
    days = first.span_s / 86400
    defrag = first.defrag
    budget = "1 % of running GPU pods" if defrag.per_hour is None else str(defrag.per_hour)
    moves = (f"defrag on (after {defrag.after_s:g}s, budget {budget} per hour)" if defrag.enabled else "defrag off")
    main = Table(title=f"time mode, trace {first.trace}: {first.stats.capacity_milli // 1000} GPUs, "
                       f"{first.policy}, {days:g} days per load, seed {first.seed}, {moves}",
                 caption="allocated %: GPU capacity allocated, time-averaged; idle GPU-h waiting: free GPU capacity "
                         "integrated over the time some pod waited; migrations: pods moved by the consolidate "
                         "action (moved %: of the pods that arrived)")
    for column in ("load", "offered %", "allocated %", "idle GPU-h waiting", "queue non-empty %", "arrivals",
                   "gave up", "preemptions", "migrations", "moved %", "events", "seconds"):
        main.add_column(column, justify="right")
    for r in reports:
        s = r.stats
        main.add_row(f"{r.load:g}", f"{r.offered_pct:.2f}", f"{r.allocated_pct:.2f}",
                     f"{r.idle_gpu_hours_while_waiting:.1f}", f"{100 * s.waiting_s / r.span_s:.2f}",
                     str(s.arrivals), str(s.gave_up), str(s.preemptions), str(s.migrations), f"{r.moved_pct:.2f}",
                     str(s.events),
                     f"{s.seconds:.1f}")
    delays = Table(title="queueing delay of placed pods, per priority (seconds)")
    for column in ("load", "priority class", "value", "placed", "p50", "p99"):
        delays.add_column(column, justify="left" if column == "priority class" else "right")
    for r in reports:
        for cls, d in r.delay_percentiles().items():
            delays.add_row(f"{r.load:g}", cls, str(r.priorities[cls]), str(d["placed"]), f"{d['p50_s']:.1f}",
                           f"{d['p99_s']:.1f}")
    return [main, delays] + ([gang_table(reports)] if first.gang_spec is not None else [])


def gang_table(reports: Sequence[TimeReport]) -> Table:
    """Gangs per load: how many arrived, were placed whole, gave up, and their wait (arrival to placed whole)."""
    spec = reports[0].gang_spec
    table = Table(title=f"gangs (--gangs {spec}: PodGroups of that many pods, all or nothing)",
                  caption="delay: arrival to placed whole, seconds; members preempted: evicted by a preemption "
                          "(each rejoins its gang unless the gang ended first); gangs arrived but neither placed nor "
                          "given up still wait at the end")
    for column in ("load", "arrived", "placed", "gave up", "preempting", "members preempted", "delay p50",
                   "delay p99"):
        table.add_column(column, justify="right")
    for r in reports:
        if r.gangs is None or r.gang_spec is None:
            continue
        g = r.gangs.json(r.gang_spec)
        d = g["queueing_delay"]
        assert isinstance(d, dict)
        table.add_row(f"{r.load:g}", str(g["arrived"]), str(g["placed"]), str(g["gave_up"]),
                      str(g["preempting_gangs"]), str(g["members_preempted"]), f"{d['p50_s']:.1f}",
                      f"{d['p99_s']:.1f}")
    return table


def plot_time(reports: Sequence[TimeReport], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for r in reports:
        hours = [p.time / 3600 for p in r.stats.samples]
        label = f"load {r.load:g}"
        axes[0].plot(hours, [p.allocated_pct for p in r.stats.samples], label=label, linewidth=1.2)
        axes[1].plot(hours, [p.queue for p in r.stats.samples], label=label, linewidth=1.2)
        axes[2].plot(hours, [p.fragmented_pct or 0.0 for p in r.stats.samples], label=label, linewidth=1.2)
    for ax, what in zip(axes, ("allocated GPUs (% of capacity)", "waiting pods", "fragmented GPUs (% of capacity)"),
                        strict=True):
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    axes[2].set_xlabel("simulated hours")
    first = reports[0]
    axes[0].set_title(f"{first.trace}: {first.stats.capacity_milli // 1000} GPUs, {first.policy}, seed {first.seed}")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
