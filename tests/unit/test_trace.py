"""The openb CSV readers: every bad input names its file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from gpupool_sched.simulate.arrivals import read_event_order, seeded_arrivals
from gpupool_sched.simulate.trace import TraceError, read_nodes, read_pods, read_trace

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,T4\nn1,96000,393216,8,G2\nc0,32000,1000,0,\n"
PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
    "p0,4000,8192,1,500,,LS,Running,0,1,0\n"
    "p1,8000,16384,2,1000,G2,LS,Running,0,1,0\n"
    "p2,1000,100,0,0,,BE,Running,0,1,0\n"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_reads_nodes_and_pods(tmp_path):
    nodes = read_nodes(write(tmp_path, "n.csv", NODES))
    assert [n.name for n in nodes] == ["n0", "n1"]  # CPU-only nodes are not part of the GPU cluster
    assert [g.model for g in nodes[1].gpus] == ["G2"] * 8
    pods = read_pods(write(tmp_path, "p.csv", PODS), nodes)
    assert [(p.gpu_count, p.gpu_milli, sorted(p.gpu_models)) for p in pods] == [
        (1, 500, []),
        (2, 1000, ["G2"]),
        (0, 0, []),
    ]


def test_gzip_and_five_column_pod_lists(tmp_path):
    nodes = tmp_path / "n.csv.gz"
    nodes.write_bytes(gzip.compress(NODES.encode()))
    pods = write(
        tmp_path, "openb_pod_list_multigpu20.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,4,1000\n"
    )
    trace = read_trace(nodes, pods)
    assert trace.name == "multigpu20" and trace.total_gpus == 10 and trace.pods[0].gpu_count == 4


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("p9,4000,8192,1,500", ":5: truncated row: 5 of 11 fields"),
        ("p9,4000,8192,1,500,,LS,Running,0,1,0,extra", ":5: 12 fields, header has 11"),
        ("p9,four,8192,1,500,,LS,Running,0,1,0", ":5: cpu_milli must be an integer, got 'four'"),
        ("p9,-5,8192,1,500,,LS,Running,0,1,0", ":5: cpu_milli must be >= 0, got -5"),
        ("p9,4000,8192,1,1500,,LS,Running,0,1,0", ":5: pod p9: gpu_milli must be 1..1000 per GPU, got 1500"),
        ("p9,4000,8192,0,300,,LS,Running,0,1,0", ":5: pod p9 has gpu_milli=300 but num_gpu=0"),
        ("p9,4000,8192,1,500,H100,LS,Running,0,1,0", ":5: pod p9 asks for unknown GPU model(s) H100"),
        ("p0,4000,8192,1,500,,LS,Running,0,1,0", ":5: pod p0 already defined on line 2"),
        ("p9,4000,8192,2,500,,LS,Running,0,1,0", ":5: pod p9: a GPU share covers exactly one GPU"),
    ],
)
def test_bad_pod_rows_name_file_and_line(tmp_path, row, message):
    nodes = read_nodes(write(tmp_path, "n.csv", NODES))
    path = write(tmp_path, "p.csv", PODS + row + "\n")
    with pytest.raises(TraceError) as err:
        read_pods(path, nodes)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", ":1: empty file"),
        ("sn,cpu_milli,gpu\n", ":1: header lacks column(s) memory_mib, model"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn0,0,10,1,T4\n", ":2: cpu_milli must be >= 1, got 0"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn0,10,10,1,\n", ":2: node n0 has 1 GPUs but no GPU model"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn0,10,10,0,\n", "no GPU nodes in the file"),
    ],
)
def test_bad_node_files(tmp_path, text, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_nodes(write(tmp_path, "n.csv", text))


def test_unreadable_files(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_nodes(tmp_path / "missing.csv")
    bad = tmp_path / "x.csv.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(TraceError, match="not a valid gzip file"):
        read_nodes(bad)


def test_a_pod_that_can_never_fit_is_kept_and_reported(tmp_path):
    nodes = write(tmp_path, "n.csv", NODES)
    pods = write(tmp_path, "p.csv", PODS + "big,200000,8192,1,1000,,LS,Running,0,1,0\n")
    trace = read_trace(nodes, pods)
    assert len(trace.pods) == 4
    assert trace.warnings == (
        f"{pods}:5: pod big cannot fit on any node even when the cluster is empty "
        "(largest node: 96000 milli-CPU, 393216 MiB)",
    )


def test_seeded_arrivals_reach_the_target_and_are_reproducible(tmp_path):
    trace = read_trace(write(tmp_path, "n.csv", NODES), write(tmp_path, "p.csv", PODS))
    capacity = trace.total_gpus * 1000
    a = seeded_arrivals(trace.pods, capacity, seed=5)
    assert [p.name for p in a] == [p.name for p in seeded_arrivals(trace.pods, capacity, seed=5)]
    total = sum(p.gpu_milli_total for p in a)
    assert 1.3 * capacity - 2000 < total <= 1.3 * capacity
    assert sum(1 for p in a if "-tuned-" in p.name) == len(a) - 3


def test_event_order_errors(tmp_path):
    path = tmp_path / "o.csv.gz"
    path.write_bytes(gzip.compress(b"kind,seed,key,value\npod,42,0,p0\nnode,42,n0,0001-n0\n"))
    with pytest.raises(TraceError, match="no rows for seed 7 \\(seeds present: 42\\)"):
        read_event_order(path, 7)
    order = read_event_order(path, 42)
    with pytest.raises(TraceError, match="no tie-break name for node\\(s\\) n1"):
        order.tie_order(["n0", "n1"], str(path))
    path.write_bytes(gzip.compress(b"kind,seed,key,value\npod,42,zero,p0\n"))
    with pytest.raises(TraceError, match=":2: pod index must be an integer"):
        read_event_order(path, 42)
