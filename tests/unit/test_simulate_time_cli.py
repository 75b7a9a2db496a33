"""`gpupool simulate --mode time` as a user runs it (the tiny traces below), its flags' bad values (one line,
exit 2), and the trace's time columns as the time mode reads them (lifetimes.py's rules)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool_sched.cli import main
from gpupool_sched.simulate.lifetimes import (
    QOS_PRIORITY,
    PodTimes,
    default_lifetimes,
    read_pod_times,
    shape_key,
    timed_pods,
)
from gpupool_sched.simulate.trace import TraceError, read_trace

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,131072,4,T4\n" for i in range(4))
HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
          "creation_time,deletion_time,scheduled_time\n")
TIMED = HEADER + "".join(
    f"p{i},2000,4096,{1 + i % 2},1000,,{('LS', 'BE')[i % 2]},Running,"
    f"{100 * i},{100 * i + 3600 + 60 * i},{100 * i + 5}\n"
    for i in range(12)
) + "never,2000,4096,1,1000,,BE,Pending,50,170,\n"
PLAIN = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"q{i},2000,4096,1,{(500, 1000)[i % 2]}\n"
                                                                   for i in range(8))


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "timed.csv").write_text(TIMED)
    (tmp_path / "plain.csv").write_text(PLAIN)
    return tmp_path / "nodes.csv", tmp_path / "timed.csv", tmp_path / "plain.csv"


def test_time_mode_writes_a_report_per_load(tmp_path: Path, files: tuple[Path, Path, Path]) -> None:
    nodes, timed, _ = files
    out = subprocess.run(
        [sys.executable, "-m", "gpupool_sched.cli", "simulate", "--mode", "time", "--nodes", str(nodes),
         "--pods", str(timed), "--load", "0.7,1.3", "--days", "0.5", "--horizon", "1", "--json",
         str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "time mode, trace timed" in out.stdout and "queueing delay" in out.stdout
    reports = json.loads((tmp_path / "t.json").read_text())
    assert [r["load"] for r in reports] == [0.7, 1.3]
    assert all(r["mode"] == "time" and r["policy"] == "gpupool" and r["defrag"] == "on" for r in reports)
    assert all(r["defrag_after_s"] == 60.0 and r["defrag_budget_per_hour"] is None for r in reports)  # the scheduler's
    assert set(reports[0]["queueing_delay"]) == {"sim-latency-sensitive", "sim-best-effort"}
    assert reports[0]["allocated_pct"] < reports[1]["allocated_pct"]
    assert reports[1]["gave_up"] + reports[1]["preemptions"] > 0  # 130% of capacity cannot all run
    assert len(reports[0]["series"]) == 200  # --plot samples the run over time
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_defrag_off_moves_nothing_and_the_budget_is_reported(tmp_path: Path, files: tuple[Path, Path, Path]) -> None:
    nodes, timed, _ = files
    common = ["simulate", "--mode", "time", "--nodes", str(nodes), "--pods", str(timed), "--load", "1.3",
              "--days", "0.2", "--horizon", "1"]
    assert main([*common, "--defrag", "off", "--json", str(tmp_path / "off.json")]) == 0
    [off] = json.loads((tmp_path / "off.json").read_text())
    assert (off["defrag"], off["migrations"], off["moved_pct_of_arrivals"]) == ("off", 0, 0.0)
    assert main([*common, "--defrag-budget", "5", "--defrag-after", "30", "--json", str(tmp_path / "on.json")]) == 0
    [on] = json.loads((tmp_path / "on.json").read_text())
    assert (on["defrag"], on["defrag_after_s"], on["defrag_budget_per_hour"]) == ("on", 30.0, 5)


def test_gangs_are_reported_beside_the_pods(tmp_path: Path, files: tuple[Path, Path, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    nodes, timed, _ = files
    common = ["simulate", "--mode", "time", "--nodes", str(nodes), "--pods", str(timed), "--load", "1.0",
              "--days", "0.2", "--horizon", "1", "--defrag", "off"]
    assert main([*common, "--json", str(tmp_path / "lone.json")]) == 0
    assert "gangs (--gangs" not in capsys.readouterr().out
    assert main([*common, "--gangs", "1:2", "--json", str(tmp_path / "gangs.json")]) == 0
    assert "gangs (--gangs 1:2" in capsys.readouterr().out
    [lone] = json.loads((tmp_path / "lone.json").read_text())
    [ganged] = json.loads((tmp_path / "gangs.json").read_text())
    assert "gangs" not in lone
    gangs = ganged["gangs"]
    assert (gangs["share"], gangs["size"]) == (1.0, 2) and gangs["arrived"] > 0
    assert gangs["placed"] + gangs["gave_up"] <= gangs["arrived"]
    assert set(gangs["queueing_delay"]) == {"placed", "p50_s", "p99_s"}
    # every 2-GPU arrival is a gang of two: the rate is lowered so that the offered load stays
    assert ganged["arrival_rate_per_s"] < lone["arrival_rate_per_s"]


def test_the_arrivals_replay_is_unchanged_by_default(files: tuple[Path, Path, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    nodes, timed, _ = files
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(timed), "--policy", "best-fit"]) == 0
    assert "arrivals, seed 42" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "time", "--load", "0"], "--load '0': each load must be in (0, 10], got 0"),
    (["--mode", "time", "--load", "1,x"], "--load '1,x': 'x' is not a number"),
    (["--mode", "time", "--load", "nan"], "each load must be in (0, 10]"),
    (["--mode", "time", "--days", "0"], "--days must be in (0, 365] days, got 0"),
    (["--mode", "time", "--horizon", "-1"], "--horizon must be in (0, 365] days"),
    (["--mode", "time", "--patience", "-5"], "--patience must be in 0..100000000 seconds, got -5"),
    (["--mode", "time", "--policy", "fgd,gpupool"], "--mode time runs one policy"),
    (["--mode", "time", "--bound"], "--bound is for the arrivals replay; --mode time does not take it"),
    (["--mode", "time", "--sample-percentage", "50"], "--sample-percentage is for the arrivals replay"),
    (["--mode", "time", "--ratio", "1.5"], "--ratio is for the arrivals replay; --mode time does not take it"),
    (["--ratio", "0"], "--ratio must be in (0, 10], got 0"),
    (["--load", "0.8"], "--load is for --mode time"),
    (["--days", "1"], "--days is for --mode time"),
    (["--defrag-budget", "3"], "--defrag-budget is for --mode time"),
    (["--mode", "time", "--defrag-after", "-1"], "--defrag-after must be a non-negative number of seconds, got -1"),
    (["--mode", "time", "--defrag-budget", "-1"], "--defrag-budget must not be negative, got -1"),
    (["--mode", "time", "--from-cluster"], "--from-cluster decides the live cluster's pending pods once; it has no"),
    (["--gangs", "0.5:4"], "--gangs is for --mode time"),
    (["--mode", "time", "--gangs", "0.5"], "--gangs '0.5': expected SHARE:SIZE, e.g. 0.5:4"),
    (["--mode", "time", "--gangs", "0:4"], "--gangs '0:4': SHARE must be in (0, 1], got 0"),
    (["--mode", "time", "--gangs", "x:4"], "--gangs 'x:4': SHARE 'x' is not a number"),
    (["--mode", "time", "--gangs", "0.5:1"], "--gangs '0.5:1': SIZE must be in 2..64, got 1"),
    (["--mode", "time", "--gangs", "0.5:2.5"], "--gangs '0.5:2.5': SIZE '2.5' is not an integer"),
])
def test_bad_time_flags_give_one_line_and_exit_2(files: tuple[Path, Path, Path], args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    nodes, timed, _ = files
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(timed), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_bad_time_cell_names_its_line(tmp_path: Path, files: tuple[Path, Path, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    nodes, _, _ = files
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "p0,2000,4096,1,1000,,LS,Running,100,50,100\n")
    assert main(["simulate", "--mode", "time", "--nodes", str(nodes), "--pods", str(bad)]) == 2
    assert f"{bad}:2: deletion_time must be >= 100, got 50" in capsys.readouterr().err
    bad.write_text(HEADER + "p0,2000,4096,1,1000,,XX,Running,0,50,10\n")
    assert main(["simulate", "--mode", "time", "--nodes", str(nodes), "--pods", str(bad)]) == 2
    assert f"{bad}:2: qos must be one of Guaranteed, LS, Burstable, BE or empty, got 'XX'" in capsys.readouterr().err


def test_lifetimes_patience_and_priorities_follow_the_trace(files: tuple[Path, Path, Path]) -> None:
    nodes, timed, _ = files
    times = read_pod_times(timed)
    assert times["p3"] == PodTimes(3600.0 + 180 - 5, 5.0, *QOS_PRIORITY["BE"])
    assert times["never"] == PodTimes(None, 120.0, *QOS_PRIORITY["BE"])  # gave up after 120 s
    trace = read_trace(nodes, timed)
    pods = {p.request.name: p for p in timed_pods(trace.pods, times, horizon_s=3000.0, default_patience_s=600.0,
                                                  seed=1)}
    assert pods["p0"].lifetime_s == 3000.0  # capped at the horizon
    assert pods["p0"].patience_s == 600.0  # waited 5 s in the trace without giving up: the default
    assert pods["never"].patience_s == 120.0
    assert pods["p3"].request.priority == 0 and pods["p2"].request.priority == 2000
    # never ran: a lifetime of a scheduled 1-GPU pod of the file (the even ones), capped
    assert pods["never"].lifetime_s in {min(3600.0 + 60 * i - 5, 3000.0) for i in range(0, 12, 2)}


def test_a_file_without_time_columns_borrows_the_default_traces_lifetimes(files: tuple[Path, Path, Path]) -> None:
    nodes, _, plain = files
    assert read_pod_times(plain) == {}
    trace = read_trace(nodes, plain)
    pods = timed_pods(trace.pods, {}, horizon_s=7 * 86400.0, default_patience_s=600.0, seed=3)
    reference = default_lifetimes()
    everyone = [x for xs in reference.values() for x in xs]
    assert (1, 1000) in reference and (1, 500) not in reference  # q1 borrows by shape, q0 from anyone
    for p in pods:
        pool = reference.get(shape_key(p.request)) or everyone
        assert p.lifetime_s in {min(x, 7 * 86400.0) for x in pool}
        assert p.patience_s == 600.0 and p.priority_class == "default" and p.request.priority == 0


def test_an_unknown_qos_is_a_trace_error(tmp_path: Path) -> None:
    bad = tmp_path / "p.csv"
    bad.write_text(HEADER + "p0,1,1,0,0,,gold,Running,0,1,0\n")
    with pytest.raises(TraceError, match="qos must be one of"):
        read_pod_times(bad)
