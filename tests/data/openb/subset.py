"""Rebuild this folder from a full copy of the openb trace: `python tests/data/openb/subset.py [OPENB_DIR]`.

Keeps only what tests/sim/test_faithfulness.py replays: the pod lists of its traces (unchanged, xz-compressed),
the published event orders of its (trace, seed) pairs, and the paper's results for them. The node list and the
default pod list are not copied: the package bundles them (src/gpupool_sched/simulate/data/).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import lzma
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# trace -> seeds whose published event order the faithfulness tests replay
SEEDS = {
    "default": range(42, 52),
    "gpushare40": (42, 43),
    "multigpu20": (43, 44),
    "gpuspec25": (44,),
    "gpuspec33": (45,),
    "cpu050": (45,),
}
POLICY_LABELS = ("FGD", "BestFit")
BUNDLED = ("openb_node_list_gpu_node.csv", "openb_pod_list_default.csv")
ORDER_ALIASES = {"gpuspec25": "default", "gpuspec33": "default"}  # the artifact's gpuspec orders are default's


def order_source(trace: str) -> str:
    return ORDER_ALIASES.get(trace, trace)


def write_xz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))


def main(source: Path) -> None:
    sums: list[str] = []
    for name in sorted({*BUNDLED, *(f"openb_pod_list_{trace}.csv" for trace in SEEDS)}):
        text = (source / name).read_text()
        if name not in BUNDLED:
            write_xz(HERE / f"{name}.xz", text)
        sums.append(f"{hashlib.sha256(text.encode()).hexdigest()}  {name}")  # bundled ones: checked where they are
    seeds: dict[str, set[int]] = {}
    for trace, wanted in SEEDS.items():
        seeds.setdefault(order_source(trace), set()).update(wanted)
    for trace, wanted in sorted(seeds.items()):
        name = f"openb_pod_list_{trace}.order.csv"
        raw = gzip.decompress((source / "sim_event_order" / f"{name}.gz").read_bytes()).decode()
        lines = raw.splitlines(keepends=True)
        kept = lines[:1] + [line for line in lines[1:] if int(line.split(",", 2)[1]) in wanted]
        text = "".join(kept)
        write_xz(HERE / "sim_event_order" / f"{name}.xz", text)
        sums.append(f"{hashlib.sha256(text.encode()).hexdigest()}  sim_event_order/{name}")
    out = io.StringIO()
    with open(source / "paper_alloc.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        writer = csv.DictWriter(out, reader.fieldnames or [], lineterminator="\n")
        writer.writeheader()
        for row in reader:
            if row["policy"] in POLICY_LABELS and int(row["seed"]) in SEEDS.get(row["workload"], ()):
                writer.writerow(row)
    (HERE / "paper_alloc.csv").write_text(out.getvalue())
    sums.append(f"{hashlib.sha256(out.getvalue().encode()).hexdigest()}  paper_alloc.csv")
    (HERE / "SHA256SUMS").write_text("".join(f"{line}\n" for line in sorted(sums, key=lambda s: s.split()[1])))


if __name__ == "__main__":
    default = Path(os.environ.get("GPUPOOL_OPENB", HERE.parents[3] / "shared" / "traces" / "openb"))
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
