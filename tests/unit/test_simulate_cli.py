"""`gpupool simulate` end to end as a user runs it: a real process, files in, JSON and PNG out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,131072,4,T4\n" for i in range(6))
PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(
    f"p{i},{2000 + 500 * (i % 4)},4096,{1 if i % 3 else 2},{(250, 1000, 1000)[i % 3] if i % 3 else 1000}\n"
    for i in range(40)
)


def gpupool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupool_sched.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "openb_pod_list_tiny.csv").write_text(PODS)
    return tmp_path / "nodes.csv", tmp_path / "openb_pod_list_tiny.csv"


def test_all_policies_write_json_and_plot(tmp_path, trace):
    nodes, pods = trace
    out = gpupool(
        "simulate",
        "--nodes",
        str(nodes),
        "--pods",
        str(pods),
        "--policy",
        "all",
        "--seed",
        "3",
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "r.png"),
    )
    assert out.returncode == 0, out.stderr
    reports = json.loads((tmp_path / "r.json").read_text())
    assert [r["policy"] for r in reports] == [
        "random",
        "best-fit",
        "dot-product",
        "gpu-packing",
        "gpu-clustering",
        "fgd",
        "gpupool",
    ]
    for r in reports:
        assert {"policy", "trace", "total_gpus", "curve", "final"} <= r.keys()
        assert r["trace"] == "tiny" and r["total_gpus"] == 24
        assert set(r["final"]) == {"arrived_pct", "allocated_pct", "unallocated_pct", "fragmented_pct", "failed_pods",
                                   "seconds"}
        assert r["final"]["allocated_pct"] + r["final"]["unallocated_pct"] == pytest.approx(100.0)
        assert r["curve"][0] == {"arrived_pct": 0, "allocated_pct": 0.0}
        assert all(p["allocated_pct"] <= p["arrived_pct"] + 2 for p in r["curve"])  # ±1 point window
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gpupool" in out.stdout and "unallocated" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "tetris"], "unknown policy 'tetris'"),
        (["--ratio", "0"], "--ratio must be in (0, 10]"),
        (["--event-order", "/nonexistent.csv.gz"], "/nonexistent.csv.gz: cannot read event order"),
        (["--policy", "none"], "--policy none runs no policy: give --bound with it"),
        (["--policy", "none", "--bound", "--plot", "x.png"], "--plot with --policy none: there are no allocation"),
        (["--policy", "fgd,none", "--bound"], "unknown policy 'none'"),
    ],
)
def test_bad_arguments_give_one_clear_line(trace, args, message):
    nodes, pods = trace
    out = gpupool("simulate", "--nodes", str(nodes), "--pods", str(pods), *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bound_is_printed_beside_the_policies_and_in_the_json(tmp_path, trace):
    nodes, pods = trace
    out = gpupool("simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "best-fit,fgd", "--bound",
                  "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    reports = json.loads((tmp_path / "r.json").read_text())
    assert [r["policy"] for r in reports] == ["best-fit", "fgd", "bound"]
    bound = reports[-1]
    assert bound["trace"] == "tiny" and bound["total_gpus"] == 24 and bound["pattern_lp_converged"]
    assert 0 <= bound["unallocated_pct"] <= min(r["final"]["unallocated_pct"] for r in reports[:-1])
    row = next(line for line in out.stdout.splitlines() if "bound (any policy)" in line)
    assert f">= {bound['unallocated_pct']:.2f}" in row

    alone = gpupool("simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "none", "--bound",
                    "--json", str(tmp_path / "b.json"))
    assert alone.returncode == 0, alone.stderr
    assert json.loads((tmp_path / "b.json").read_text()) == [bound | {"seconds": ANY}]
    assert "bound (any policy)" in alone.stdout and "fgd" not in alone.stdout


def test_a_truncated_csv_names_the_file_and_line(tmp_path, trace):
    nodes, _ = trace
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np1,1000,10\n")
    out = gpupool("simulate", "--nodes", str(nodes), "--pods", str(bad), "--policy", "fgd")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{bad}:3: truncated row: 3 of 5 fields" in out.stderr


def test_the_bundled_trace_is_used_by_default(tmp_path):
    out = gpupool("simulate", "--policy", "best-fit", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["trace"] == "default" and report["total_gpus"] == 6212 and report["pods"] > 10_000
    assert 90 < report["final"]["allocated_pct"] < 96
