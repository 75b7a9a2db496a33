"""`gpupool status`'s table and JSON from plain data: 80 columns, names shortened sensibly, stable fields."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpupool_sched.status.model import (
    ClusterStatus,
    Fragmentation,
    GpuStatus,
    MigSliceStatus,
    NodeStatus,
    PendingGroup,
    Totals,
)
from gpupool_sched.status.render import format_age, gpu_map, render_table, shorten

DOCS = Path(__file__).resolve().parents[2] / "docs" / "status.md"


def gpu(index: int, use: str = "free", *, health: str = "healthy", units: int = 0, pods: tuple[str, ...] = (),
        mig: tuple[MigSliceStatus, ...] = (), model: str = "NVIDIA H100 80GB HBM3") -> GpuStatus:
    return GpuStatus(index=index, uuid=f"GPU-{index:04d}", model=model, memory_mib=81559, health=health,  # type: ignore[arg-type]
                     use=use, memory_units_used=units, memory_units_total=0 if use == "mig" else 79,  # type: ignore[arg-type]
                     pods=list(pods), mig=list(mig))


def node(name: str, gpus: list[GpuStatus], *, schedulable: bool = True, problem: str | None = None) -> NodeStatus:
    return NodeStatus(
        name=name, model=gpus[0].model if gpus else "", schedulable=schedulable, inventory_problem=problem,
        memory_unit_mib=1024 if gpus else None, gpus=len(gpus),
        whole=sum(g.use == "whole" for g in gpus), shared=sum(g.use == "shared" for g in gpus),
        free=sum(g.use == "free" and g.health == "healthy" for g in gpus), mig=sum(g.use == "mig" for g in gpus),
        unhealthy=sum(g.health == "unhealthy" for g in gpus),
        memory_units_used=sum(g.memory_units_used for g in gpus),
        memory_units_total=sum(g.memory_units_total for g in gpus),
        mig_slices_used=sum(s.pod is not None for g in gpus for s in g.mig),
        mig_slices_total=sum(len(g.mig) for g in gpus), gpu_list=gpus,
    )


LONG_NODE = "gpu-pool-training-cluster-eu-west-4-rack-17-dgx-h100-node-0042"
LONG_POD = "inference-team-with-a-very-long-namespace/llama-70b-serving-deployment-7f9c8d6b5-x2x9q"


def cluster() -> ClusterStatus:
    slices = tuple(MigSliceStatus(uuid=f"MIG-{i}", profile="1g.10gb" if i < 7 else "3g.40gb",
                                  health="unhealthy" if i == 3 else "healthy", pod=f"ns/mig-{i}" if i < 2 else None)
                   for i in range(8))
    nodes = [
        node(LONG_NODE, [gpu(0, "whole", pods=("ns/train-0",)), gpu(1, "whole", pods=("ns/train-0",)),
                         gpu(2, "shared", units=30, pods=tuple(f"{LONG_POD}-{i}" for i in range(5))),
                         gpu(3, health="unhealthy"), gpu(4, "mig", mig=slices), *(gpu(i) for i in range(5, 8))]),
        node("big-16", [gpu(i, "whole" if i % 3 == 0 else "free", pods=("ns/p",) if i % 3 == 0 else ())
                        for i in range(20)]),
        node("cpu-only", []),
        node("broken", [], problem="gpupool.io/gpu-inventory unusable: version 7 is not supported (want 1)"),
        node("cordoned", [gpu(0)], schedulable=False),
    ]
    pending = [
        PendingGroup(priority=1_000_000, priority_class="train-critical", pods=3, oldest_age_seconds=754.0,
                     oldest_pod="ml/train-llm-0"),
        PendingGroup(priority=100, priority_class="a-priority-class-name-far-longer-than-the-column", pods=12,
                     oldest_age_seconds=3 * 86400 + 5000, oldest_pod=LONG_POD),
        PendingGroup(priority=0, priority_class=None, pods=1, oldest_age_seconds=5, oldest_pod="default/x"),
    ]
    return ClusterStatus(
        generated_at="2025-06-01T12:00:00Z", server="https://127.0.0.1:6443", scheduler_name="gpupool",
        memory_unit_mib=1024, selector=None,
        totals=Totals(nodes=5, gpus=29, whole=9, shared=1, free=17, mig=1, unhealthy=1, memory_units_used=30,
                      memory_units_total=2212, mig_slices_used=2, mig_slices_total=8, pending_pods=16,
                      unknown_device_pods=2),
        fragmentation=Fragmentation(percent=12.345, gpus=3.58, allocated_percent=33.3, profile="observed",
                                    pods_observed=812),
        pending=pending, nodes=nodes,
    )


@pytest.mark.parametrize("view", [{}, {"node": LONG_NODE}, {"node": "big-16"}, {"node": "broken"}])
def test_every_line_fits_80_columns(view: dict[str, Any]) -> None:
    text = render_table(cluster(), **view)
    lines = text.splitlines()
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, "\n".join(too_long)
    assert all(line == line.rstrip() for line in lines)


def test_summary_and_node_lines() -> None:
    lines = render_table(cluster()).splitlines()
    assert lines[0].startswith("gpupool status: 5 nodes, 29 GPUs, 16 pending pods")
    assert lines[0].endswith("2025-06-01T12:00:00Z")
    assert "9 whole, 1 shared, 17 free, 1 MIG, 1 unhealthy; allocated 33.3%" in lines[1]
    assert "30/2212 memory units used (1 unit = 1024 MiB); MIG slices 2/8 used" in lines[2]
    assert lines[3].startswith("fragment  12.3% of GPU capacity (3.58 GPUs) idle and unusable;")
    assert lines[4].startswith(" " * 10 + "from 812 pods")  # wrapped, aligned under the text
    assert "workload: learnt from 812 pods" in " ".join(line.strip() for line in lines[3:5])
    assert "2 bound GPU pods without assignment or ack" in lines[5]
    row = next(line for line in lines if line.startswith("gpu-pool-"))
    name = row.split()[0]
    assert "~" in name and LONG_NODE.startswith(name.split("~")[0]) and LONG_NODE.endswith(name.split("~")[1])
    assert name.endswith("-0042")  # the distinguishing tail survives
    assert row.split()[1:] == ["H100", "80GB", "HBM3", "8", "WWS!M...", "3", "30/553", "2/8"]
    big = next(line for line in lines if line.startswith("big-16"))
    assert "W..W..W..W..W..+" in big  # 20 GPUs in 16 characters
    assert re.search(r"^cpu-only\s+-\s+0\s+-\s+0\s+-\s+-$", next(x for x in lines if x.startswith("cpu-only")))
    assert any(line.startswith("cordoned (cordoned)") for line in lines)
    assert any(line.startswith("! broken: gpupool.io/gpu-inventory unusable") for line in lines)


def test_node_detail_wraps_pods_and_shows_mig_layout() -> None:
    lines = render_table(cluster(), node=LONG_NODE).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("node "))
    assert lines[start].startswith("node gpu-pool-") and lines[start].endswith("-0042:")
    assert lines[start + 1] == "  NVIDIA H100 80GB HBM3 x8; 30/553 units of 1024 MiB"
    table = lines[start + 2:]
    assert table[0].split() == ["GPU", "USE", "HEALTH", "UNITS", "HELD", "BY"]
    assert table[1].split() == ["0", "whole", "healthy", "-", "ns/train-0"]
    shared = next(i for i, line in enumerate(table) if line.split()[:2] == ["2", "shared"])
    assert table[shared].split()[3] == "30/79"
    continuation = table[shared + 1]
    indent = table[0].index("HELD BY")
    assert continuation[:indent].strip() == "" and continuation[indent:].strip()  # wrapped under HELD BY
    assert "~" in continuation  # a pod name longer than the column is shortened, not split
    mig = next(line for line in table if line.split()[:2] == ["4", "mig"])
    assert mig.endswith("1g.10gb:2/7 3g.40gb:0/1, 1 unhealthy")
    assert table[table.index(mig) + 1].strip() == "ns/mig-0, ns/mig-1"
    assert next(line for line in table if line.split()[:1] == ["3"]).split()[:3] == ["3", "free", "unhealthy"]


def test_wide_lists_every_node_and_never_shortens() -> None:
    text = render_table(cluster(), wide=True)
    assert LONG_NODE in text and f"{LONG_POD}-4" in text
    assert text.count("\nnode ") == 5
    assert "W..W..W..W..W..W..W" in text  # the whole map
    assert "a-priority-class-name-far-longer-than-the-column" in text


def test_pending_by_priority() -> None:
    lines = render_table(cluster()).splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["PRIORITY"])
    rows = [line.split() for line in lines[head + 1:head + 4]]
    assert rows[0] == ["1000000", "train-critical", "3", "12m", "ml/train-llm-0"]
    assert rows[1][0] == "100" and rows[1][1].startswith("a-priority") and "~" in rows[1][1]
    assert rows[1][2:4] == ["12", "3d1h"]
    assert rows[2] == ["0", "(none)", "1", "5s", "default/x"]


def test_empty_cluster() -> None:
    status = cluster().model_copy(update={"nodes": [], "pending": []})
    text = render_table(status)
    assert "no nodes" in text and "no pending GPU pods" in text


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (119, "119s"), (312, "5m12s"), (2520, "42m"), (3600 + 300, "1h5m"), (2 * 86400 + 4 * 3600, "2d4h"),
    (-5, "0s"),
])
def test_format_age(seconds: float, text: str) -> None:
    assert format_age(seconds) == text


def test_shorten() -> None:
    assert shorten("abcdef", 6) == "abcdef"
    assert shorten("abcdefghij", 7) == "abc~hij"
    assert len(shorten("x" * 100, 13)) == 13
    assert shorten("abc", 1) == "a"


def test_gpu_map_marks_unhealthy_over_use() -> None:
    n = node("n", [gpu(0, "whole", health="unhealthy", pods=("a/b",)), gpu(1, "shared", units=1), gpu(2)])
    assert gpu_map(n, 16) == "!S."


# ---- JSON ------------------------------------------------------------------------------------------
FIELDS = {
    "ClusterStatus": ["version", "generated_at", "server", "scheduler_name", "memory_unit_mib", "selector", "totals",
                      "fragmentation", "pending", "nodes"],
    "Totals": ["nodes", "gpus", "whole", "shared", "free", "mig", "unhealthy", "memory_units_used",
               "memory_units_total", "mig_slices_used", "mig_slices_total", "pending_pods", "unknown_device_pods"],
    "Fragmentation": ["percent", "gpus", "allocated_percent", "profile", "pods_observed"],
    "PendingGroup": ["priority", "priority_class", "pods", "oldest_age_seconds", "oldest_pod"],
    "NodeStatus": ["name", "model", "schedulable", "inventory_problem", "memory_unit_mib", "gpus", "whole", "shared",
                   "free", "mig", "unhealthy", "memory_units_used", "memory_units_total", "mig_slices_used",
                   "mig_slices_total", "gpu_list"],
    "GpuStatus": ["index", "uuid", "model", "memory_mib", "health", "use", "memory_units_used", "memory_units_total",
                  "pods", "mig"],
    "MigSliceStatus": ["uuid", "profile", "health", "pod"],
}


def test_json_field_names_are_stable() -> None:
    """Renaming or dropping a field breaks readers: it must bump `version` (and this list)."""
    schema = ClusterStatus.model_json_schema()
    defs = {name: body for name, body in schema["$defs"].items()}
    defs["ClusterStatus"] = schema
    assert {name: list(defs[name]["properties"]) for name in FIELDS} == FIELDS
    assert schema["properties"]["version"]["const"] == 1
    assert set(defs["GpuStatus"]["properties"]["use"]["enum"]) == {"free", "whole", "shared", "mig"}
    for name in FIELDS:
        assert set(defs[name]["required"]) >= set(FIELDS[name]) - {"version"}, name  # no field silently optional


def test_json_round_trips_and_rejects_unknown_fields() -> None:
    status = cluster()
    text = status.model_dump_json()
    assert ClusterStatus.model_validate_json(text) == status
    raw = json.loads(text)
    raw["nodes"][0]["gpu_list"][0]["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        ClusterStatus.model_validate(raw)


def test_docs_describe_every_field() -> None:
    docs = DOCS.read_text()
    missing = sorted({f for fields in FIELDS.values() for f in fields if f"`{f}`" not in docs})
    assert not missing, f"docs/status.md does not describe: {missing}"


def test_an_empty_cluster_shows_no_fragmentation_figure_and_a_unit_is_a_size() -> None:
    """On an empty cluster the demo printed "fragment 14.0% ... workload: prior" (FGD's measure of the prior
    mix against empty nodes, not of any placement) and "0/2880 memory units used (1024 MiB)", which reads
    like a total (issue 22, item 6)."""
    import inspect

    from gpupool_sched.placement.workload import RollingProfile
    from gpupool_sched.status.render import PRIOR_UNTIL_PODS

    empty = cluster().model_copy(update={
        "fragmentation": Fragmentation(percent=14.0, gpus=1.12, allocated_percent=0.0, profile="prior",
                                       pods_observed=0),
        "totals": cluster().totals.model_copy(update={"mig_slices_used": 0}),
    })
    text = " ".join(render_table(empty).split())
    assert "fragment - (no GPU is in use yet: nothing is fragmented by placements)" in text
    assert "14.0%" not in text
    assert "memory units used (1 unit = 1024 MiB)" in text
    prior = cluster().model_copy(update={"fragmentation": cluster().fragmentation.model_copy(
        update={"profile": "prior", "pods_observed": 3})})
    assert "workload: prior (a built-in mix until 50 pods are seen)" in " ".join(render_table(prior).split())
    assert inspect.signature(RollingProfile).parameters["min_observations"].default == PRIOR_UNTIL_PODS
