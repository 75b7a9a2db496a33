"""The status report as text for a terminal of 80 columns.

Default: a summary, one line per node (its GPUs as one character each: the GPU map), the pending pods
by priority. `node=NAME` adds that node's GPUs one line each (who holds them, units, MIG layout);
`wide=True` does so for every node and never shortens a name (lines may then pass the width).
Long names are shortened in the middle (`pool-a~h100-12`), where they are least telling.
"""

from __future__ import annotations

import textwrap
from collections import Counter

from gpupool_sched.status.model import ClusterStatus, GpuStatus, NodeStatus, PendingGroup

WIDTH = 80
MAP_MAX = 16  # GPU map characters per node line; more GPUs end in '+'
GPU_MARK = {"whole": "W", "shared": "S", "free": ".", "mig": "M"}
UNHEALTHY_MARK = "!"
LEGEND = "GPU map: W whole  S shared  . free  M MIG  ! unhealthy"
PRIOR_UNTIL_PODS = 50  # RollingProfile's min_observations: the scheduler's profile is the prior until then


def shorten(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut in the middle with '~'."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "~" + (text[-tail:] if tail else "")


def format_age(seconds: float) -> str:
    """kubectl's style: 45s, 5m12s, 42m, 3h5m, 2d4h."""
    s = int(max(0.0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def short_model(product: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100 80GB HBM3`: the vendor says nothing in a GPU pool."""
    return product.removeprefix("NVIDIA ").removeprefix("NVIDIA-") or "-"


def gpu_map(node: NodeStatus, width: int) -> str:
    marks = "".join(UNHEALTHY_MARK if g.health == "unhealthy" else GPU_MARK[g.use] for g in node.gpu_list)
    if not marks:
        return "-"
    if len(marks) > width:
        return marks[: width - 1] + "+"
    return marks


def _fraction(used: int, total: int) -> str:
    return f"{used}/{total}" if total else "-"


def render_table(status: ClusterStatus, *, node: str | None = None, wide: bool = False, width: int = WIDTH) -> str:
    lines = _summary(status, width, wide)
    lines.append("")
    lines += _node_table(status.nodes, width, wide)
    detail = status.nodes if wide else [n for n in status.nodes if n.name == node]
    for n in detail:
        lines.append("")
        lines += node_detail(n, status.memory_unit_mib, width, wide)
    lines.append("")
    lines += _pending_table(status.pending, width, wide)
    return "\n".join(lines) + "\n"


def _summary(status: ClusterStatus, width: int, wide: bool) -> list[str]:
    t, f = status.totals, status.fragmentation
    head = f"gpupool status: {t.nodes} nodes, {t.gpus} GPUs, {t.pending_pods} pending pods"
    stamp = status.generated_at
    gap = width - len(head) - len(stamp)
    lines = [head + " " * gap + stamp if gap >= 1 else shorten(head, width)]
    if status.selector:
        lines.append(f"nodes     {status.selector} (these nodes only; pending: all)")
    lines.append(f"GPUs      {t.whole} whole, {t.shared} shared, {t.free} free, {t.mig} MIG, "
                 f"{t.unhealthy} unhealthy; allocated {f.allocated_percent:.1f}%")
    lines.append(f"units     {t.memory_units_used}/{t.memory_units_total} memory units used "
                 f"(1 unit = {status.memory_unit_mib} MiB); MIG slices {t.mig_slices_used}/{t.mig_slices_total} used")
    if f.allocated_percent == 0 and t.mig_slices_used == 0:
        # FGD on empty nodes only says which GPUs the workload's shapes could never fill: not a placement's doing
        lines.append("fragment  - (no GPU is in use yet: nothing is fragmented by placements)")
    else:
        learnt = (f"learnt from {f.pods_observed} pods" if f.profile == "observed"
                  else f"prior (a built-in mix until {PRIOR_UNTIL_PODS} pods are seen)")
        lines.append(f"fragment  {f.percent:.1f}% of GPU capacity ({f.gpus:.2f} GPUs) idle and unusable; "
                     f"workload: {learnt}")
    if t.unknown_device_pods:
        lines.append(f"guessed   {t.unknown_device_pods} bound GPU pods without assignment or ack")
    if wide:
        return lines
    wrapped = [lines[0]]  # already fits: the time stamp only shows when there is room
    for line in lines[1:]:
        wrapped += textwrap.wrap(line, width, subsequent_indent=" " * 10, break_long_words=False)
    return wrapped


def _node_table(nodes: list[NodeStatus], width: int, wide: bool) -> list[str]:
    if not nodes:
        return ["no nodes"]
    most = max((n.gpus for n in nodes), default=0)
    map_w = max(4, min(MAP_MAX, most)) if not wide else max(4, most)
    rows = [
        (n.name + ("" if n.schedulable else " (cordoned)"), short_model(n.model) if n.gpus else "-",
         str(n.gpus), gpu_map(n, map_w), str(n.free), _fraction(n.memory_units_used, n.memory_units_total),
         _fraction(n.mig_slices_used, n.mig_slices_total))
        for n in nodes
    ]
    head = ("NODE", "MODEL", "GPUS", "MAP", "FREE", "UNITS", "MIG")
    fixed = [14, 4, map_w, 4, 9, 5]  # MODEL .. MIG
    if wide:
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    else:
        widths = [max(12, width - sum(fixed) - len(fixed)), *fixed]
    right = (False, False, True, False, True, True, True)
    out = [_row(head, widths, right, wide)]
    out += [_row(r, widths, right, wide) for r in rows]
    problems = [n for n in nodes if n.inventory_problem]
    for n in problems[:5]:
        out.append(_fit(f"! {n.name}: {n.inventory_problem}", width, wide))
    if len(problems) > 5:
        out.append(f"! and {len(problems) - 5} more nodes with an unusable inventory")
    out.append(LEGEND)
    return out


def _row(cells: tuple[str, ...], widths: list[int], right: tuple[bool, ...], wide: bool) -> str:
    parts = []
    for cell, w, r in zip(cells, widths, right, strict=True):
        text = cell if wide else shorten(cell, w)
        parts.append(text.rjust(w) if r else text.ljust(w))
    return " ".join(parts).rstrip()


def _fit(line: str, width: int, wide: bool) -> str:
    return line if wide else shorten(line, width)


def node_detail(node: NodeStatus, unit_mib: int, width: int = WIDTH, wide: bool = False) -> list[str]:
    """One node's GPUs, one line each, with who holds them; long lists wrap under HELD BY."""
    models = Counter(g.model for g in node.gpu_list)
    model = ", ".join(f"{m} x{n}" for m, n in models.most_common()) or "no GPUs"
    units = (f"{node.memory_units_used}/{node.memory_units_total} units of {node.memory_unit_mib} MiB"
             if node.memory_unit_mib else "no memory units")
    state = "" if node.schedulable else ", cordoned"
    about = f"{model}; {units}{state}"
    head = f"node {node.name}: {about}"
    if wide or len(head) <= width:
        out = [head]
    else:  # the name alone on the first line, what the node is below it
        out = [f"node {shorten(node.name, width - 6)}:", *textwrap.wrap(about, width, initial_indent="  ",
                                                                         subsequent_indent="  ")]
    if node.memory_unit_mib and node.memory_unit_mib != unit_mib:
        out.append(_fit(f"  (its unit differs from the scheduler's {unit_mib} MiB: no memory shares here)",
                        width, wide))
    if node.inventory_problem:
        out.append(_fit(f"  ! {node.inventory_problem}", width, wide))
    if not node.gpu_list:
        return out
    head = f"  {'GPU':>3}  {'USE':<6}  {'HEALTH':<9}  {'UNITS':>7}  "  # HELD BY: pods; MIG: profile:used/total
    indent = len(head)
    out.append(head + "HELD BY")
    room = max(20, width - indent)
    for g in node.gpu_list:
        units = "-" if g.use == "whole" else _fraction(g.memory_units_used, g.memory_units_total)
        start = f"  {g.index:>3}  {g.use:<6}  {g.health:<9}  {units:>7}  "
        held = _held_by(g)
        if not held:
            out.append(start + "-")
            continue
        for i, text in enumerate(held):
            if wide:
                out.append((start if i == 0 else " " * indent) + text)
                continue
            wrapped = textwrap.wrap(text, room, break_long_words=False, break_on_hyphens=False) or [""]
            for j, piece in enumerate(wrapped):
                out.append((start if i == 0 and j == 0 else " " * indent) + shorten(piece, room))
    return out


def _held_by(g: GpuStatus) -> list[str]:
    """What to print under HELD BY: pods (with units for shares); for MIG, the layout then the pods."""
    if g.use == "mig":
        layout: dict[str, list[int]] = {}
        for s in g.mig:
            used, total = layout.setdefault(s.profile, [0, 0])
            layout[s.profile] = [used + (s.pod is not None), total + 1]
        text = " ".join(f"{p}:{u}/{n}" for p, (u, n) in sorted(layout.items())) or "MIG, no slices"
        bad = sum(1 for s in g.mig if s.health == "unhealthy")
        if bad:
            text += f", {bad} unhealthy"
        pods = sorted({s.pod for s in g.mig if s.pod})
        return [text, *([", ".join(pods)] if pods else [])]
    return [", ".join(g.pods)] if g.pods else []


def _pending_table(groups: list[PendingGroup], width: int, wide: bool) -> list[str]:
    if not groups:
        return ["no pending GPU pods"]
    head = ("PRIORITY", "PRIORITYCLASS", "PODS", "OLDEST", "OLDEST POD")
    rows = [(str(g.priority), g.priority_class or "(none)", str(g.pods), format_age(g.oldest_age_seconds),
             g.oldest_pod) for g in groups]
    fixed = [11, 24, 5, 7]
    if wide:
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    else:
        widths = [*fixed, max(10, width - sum(fixed) - len(fixed))]
    right = (True, False, True, True, False)
    return [_row(head, widths, right, wide), *(_row(r, widths, right, wide) for r in rows)]
