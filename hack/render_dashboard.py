#!/usr/bin/env python3
"""Render the Grafana dashboard's panels from a real Prometheus into one PNG (docs/img/dashboard.png).

Every panel of deploy/helm/gpupool/files/gpupool-dashboard.json is drawn as Grafana would draw it as
a time series: each target's PromQL is sent unchanged to /api/v1/query_range (only Grafana's
`$__rate_interval` is replaced by --rate-interval), one line per returned series, labelled with the
target's legendFormat. No Grafana is needed; tests/e2e/test_observability.py runs this against the
Prometheus that scrapes its scheduler and device plugins (GPUPOOL_RENDER_DASHBOARD=docs/img/dashboard.png).

    python hack/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 5 --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "gpupool" / "files" / "gpupool-dashboard.json"
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's graph panels (rows left out), in reading order."""
    found = [p for p in dashboard["panels"] if p.get("type") != "row"]
    return sorted(found, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def promql(expr: str, rate_interval: str) -> str:
    """The target's expression as Prometheus receives it from Grafana."""
    return expr.replace("$__rate_interval", rate_interval)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt) if fmt else json.dumps(labels)


def api(base: str, path: str, **params: str | float) -> Any:
    url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as answer:
        body = json.load(answer)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    return list(api(base, "/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"])


def render(base: str, out: Path, *, start: float, end: float, step: float = 1.0, rate_interval: str = "15s",
           dashboard_path: Path = DASHBOARD) -> dict[str, int]:
    """Draw every panel into `out`; returns the number of series each panel got."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(dashboard_path.read_text())
    graphs = panels(dashboard)
    cols = 3
    rows = math.ceil(len(graphs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 6.0, rows * 3.0), squeeze=False)
    counts: dict[str, int] = {}
    for ax, panel in zip(axes.flat, graphs, strict=False):
        n = 0
        for target in panel["targets"]:
            for series in query_range(base, promql(target["expr"], rate_interval), start, end, step):
                times = [float(t) - start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                ax.plot(times, values, linewidth=1.2, label=legend(target.get("legendFormat", ""), series["metric"]))
                n += 1
        counts[panel["title"]] = n
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_xlabel("seconds", fontsize=7)
        if unit and unit != "short":
            ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if n == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif n <= 8:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(graphs):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']}: {len(graphs)} panels from Prometheus at {base}, "
                 f"{int(end - start)} s", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--minutes", type=float, default=5.0, help="range to draw, ending now")
    p.add_argument("--step", type=float, default=1.0, help="seconds between points")
    p.add_argument("--rate-interval", default="15s", help="what Grafana's $__rate_interval becomes")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    args = p.parse_args(argv)
    end = time.time()
    try:
        counts = render(args.prometheus, args.out, start=end - args.minutes * 60, end=end, step=args.step,
                        rate_interval=args.rate_interval, dashboard_path=args.dashboard)
    except (OSError, RuntimeError) as exc:
        print(f"render_dashboard: {exc}", file=sys.stderr)
        return 2
    for title, n in counts.items():
        print(f"{n:3d} series  {title}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
