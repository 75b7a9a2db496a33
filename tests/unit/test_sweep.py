"""`gpupool simulate sweep`: the grid's run list, run keys, resuming, bad grid files, and that a run's result
is what `gpupool simulate` reports for the same config."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupool_sched.cli import build_parser, main
from gpupool_sched.simulate.run import prepare_workload, simulate
from gpupool_sched.simulate.sweep import LocalProcesses, RunOutput, run_one, run_sweep
from gpupool_sched.simulate.sweep_grid import BOUND, RunConfig, load_grid
from gpupool_sched.simulate.trace import BUNDLED_NODES, BUNDLED_PODS, bundled_path, read_trace

REPO = Path(__file__).resolve().parents[2]
SMALL = {"traces": ["default"], "seeds": [1, 2], "policies": ["fgd", "best-fit"], "parameters": {"ratio": 0.05}}


def write_grid(folder: Path, grid: dict[str, Any] | str, name: str = "grid.yaml") -> Path:
    path = folder / name
    path.write_text(grid if isinstance(grid, str) else yaml.safe_dump(grid))
    return path


class Counting:
    """A backend that runs in this process and records which runs it was given."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def __call__(self, configs: Sequence[RunConfig], done: Callable[[RunOutput], None]) -> None:
        for config in configs:
            self.ran.append(config.key)
            done(run_one(config))


def sweep_cli(tmp_path: Path, grid: Path, *extra: str) -> int:
    return main(["simulate", "sweep", "--grid", str(grid), "--out", str(tmp_path / "out"), *extra])


def test_the_grid_is_the_cross_product(tmp_path: Path) -> None:
    grid = dict(SMALL, parameters={"ratio": [0.05, 0.1], "profile_source": ["trace", "rolling"]}, bound=True)
    runs = load_grid(write_grid(tmp_path, grid), None, "0.1.0").runs
    policies = [r for r in runs if r.policy != BOUND]
    assert len(policies) == 1 * 2 * 2 * 2 * 2  # traces x seeds x ratios x profile sources x policies
    assert {(r.seed, r.parameters.ratio, r.parameters.profile_source, r.policy) for r in policies} == {
        (s, ratio, src, p) for s in (1, 2) for ratio in (0.05, 0.1) for src in ("trace", "rolling")
        for p in ("fgd", "best-fit")}
    # one bound per trace, seed and ratio: the other parameters do not change the arrivals it bounds
    assert sorted((r.seed, r.parameters.ratio) for r in runs if r.policy == BOUND) == [
        (1, 0.05), (1, 0.1), (2, 0.05), (2, 0.1)]
    assert len({r.key for r in runs}) == len(runs)


def test_a_second_sweep_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = write_grid(tmp_path, SMALL)
    assert sweep_cli(tmp_path, grid, "--workers", "1") == 0
    assert "sweep: 4 runs, 0 finished before (skipped), 4 run now" in capsys.readouterr().out
    files = {p.name: p.read_bytes() for p in (tmp_path / "out" / "runs").iterdir()}
    assert len(files) == 4
    assert sweep_cli(tmp_path, grid, "--workers", "1") == 0
    out = capsys.readouterr().out
    assert "sweep: 4 runs, 4 finished before (skipped), 0 run now" in out
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "runs").iterdir()} == files
    combined = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["config"]["policy"] for r in combined["runs"]] == ["fgd", "best-fit"] * 2
    assert all(isinstance(r["seconds"], float) for r in combined["runs"])  # timing kept from the first sweep
    # and the runner itself hands the backend nothing
    backend = Counting()
    outcome = run_sweep(load_grid(grid, None, "0.1.0").runs, tmp_path / "out", backend)
    assert backend.ran == [] and outcome.skipped == 4 and outcome.ran == 0


def test_a_run_key_changes_with_its_config_trace_and_version(tmp_path: Path) -> None:
    def key(grid: dict[str, Any], version: str = "0.1.0") -> list[str]:
        return [r.key for r in load_grid(write_grid(tmp_path, grid, "k.yaml"), None, version).runs]

    base = key(SMALL)
    assert key(dict(SMALL, parameters={"ratio": 0.06})) != base
    assert set(key(dict(SMALL, seeds=[1]))) < set(base)  # a subset of the grid keeps its keys
    assert set(key(dict(SMALL, seeds=[3]))).isdisjoint(base)
    assert set(key(dict(SMALL, parameters={"ratio": 0.05, "sample_percentage": 50}))).isdisjoint(base)
    assert key(SMALL, "0.2.0") != base
    # a parameter given at its default value is the same run: a new knob leaves old keys alone
    assert key(dict(SMALL, parameters={"ratio": 0.05, "profile_source": "trace", "sample_scan": "fixed"})) == base
    assert load_grid(write_grid(tmp_path, SMALL, "k.yaml"), None, "0.1.0").runs[0].canonical()["parameters"] == {
        "ratio": 0.05}
    # the same trace files elsewhere: same keys; one changed pod line: new keys
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_bytes(gzip.decompress(bundled_path(BUNDLED_NODES).read_bytes()))
    pods.write_bytes(gzip.decompress(bundled_path(BUNDLED_PODS).read_bytes()))
    mapped = dict(SMALL, traces=[{"nodes": str(nodes), "pods": str(pods)}])
    first = key(mapped)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(nodes, moved / "n.csv")
    shutil.copy(pods, moved / "pods.csv")
    assert key(dict(SMALL, traces=[{"nodes": "moved/n.csv", "pods": "moved/pods.csv"}])) == first
    lines = pods.read_text().splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    row[head.index("cpu_milli")] = str(int(row[head.index("cpu_milli")]) + 1)
    pods.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    assert set(key(mapped)).isdisjoint(first)


def test_corrupt_partial_or_foreign_result_files_are_run_again(tmp_path: Path) -> None:
    grid = write_grid(tmp_path, SMALL)
    runs = load_grid(grid, None, "0.1.0").runs
    out = tmp_path / "out"
    run_sweep(runs, out, Counting())
    good = {r.key: (out / "runs" / f"{r.key}.json").read_bytes() for r in runs}
    partial, garbage, foreign, fine = (r.key for r in runs)
    (out / "runs" / f"{partial}.json").write_bytes(good[partial][: len(good[partial]) // 2])
    (out / "runs" / f"{garbage}.json").write_bytes(b"\x00\xff not json")
    (out / "runs" / f"{foreign}.json").write_bytes(good[fine])  # a whole result, of another run
    backend = Counting()
    outcome = run_sweep(runs, out, backend)
    assert sorted(backend.ran) == sorted([partial, garbage, foreign])
    assert outcome.skipped == 1 and outcome.ran == 3
    assert {r.key: (out / "runs" / f"{r.key}.json").read_bytes() for r in runs} == good
    assert not list((out / "runs").glob(".*.tmp"))  # atomic writes leave no temporary files


def test_a_run_is_what_gpupool_simulate_reports(tmp_path: Path) -> None:
    grid = dict(SMALL, seeds=[7], policies=["gpupool"], parameters={"ratio": 0.1, "profile_source": "rolling",
                                                                     "sample_percentage": 50})
    (config,) = load_grid(write_grid(tmp_path, grid), None, "0.1.0").runs
    result = json.loads(run_one(config).result_json)
    trace = read_trace()
    (report,) = simulate(trace, prepare_workload(trace, 7, None, 0.1), ["gpupool"], sample_percentage=50,
                         profile_source="rolling")
    expected = report.model_dump()
    expected["final"].pop("seconds")
    assert result["result"] == expected
    assert result["key"] == config.key and result["config"]["parameters"] == {
        "ratio": 0.1, "profile_source": "rolling", "sample_percentage": 50}


def test_local_processes_write_the_same_files_as_one_process(tmp_path: Path) -> None:
    runs = load_grid(write_grid(tmp_path, SMALL), None, "0.1.0").runs
    run_sweep(runs, tmp_path / "one", Counting())
    run_sweep(runs, tmp_path / "pool", LocalProcesses(2))
    for r in runs:
        assert (tmp_path / "one" / "runs" / f"{r.key}.json").read_bytes() == (
            tmp_path / "pool" / "runs" / f"{r.key}.json").read_bytes()


BAD_GRIDS: list[tuple[str, dict[str, Any] | str, str]] = [
    ("not yaml", "traces: [default\nseeds: [1]", "not valid YAML/JSON"),
    ("a list", "- default\n- 1\n", "expected a mapping"),
    ("unknown key", dict(SMALL, policy=["fgd"]), "policy: Extra inputs are not permitted"),
    ("no seeds", dict(SMALL, seeds=[]), "seeds: List should have at least 1 item"),
    ("negative seed", dict(SMALL, seeds=[-1]), "seed -1 is not in 0.."),
    ("unknown policy", dict(SMALL, policies=["fgd", "fastest"]), "unknown policy 'fastest'"),
    ("unknown parameter", dict(SMALL, parameters={"ratios": 1.0}), "unknown parameter 'ratios'"),
    ("bad ratio", dict(SMALL, parameters={"ratio": [1.0, 11]}), "parameters.ratio: Input should be less than"),
    ("bad profile", dict(SMALL, parameters={"profile_source": "window"}), "parameters.profile_source"),
    ("family without dir", dict(SMALL, traces=["gpushare40"]), "give --traces-dir"),
    ("missing file", dict(SMALL, traces=[{"nodes": "n.csv", "pods": "p.csv"}]), "is not a file"),
    ("twice", dict(SMALL, traces=["default", "default"]), "trace 'default' is listed twice"),
]


@pytest.mark.parametrize(("case", "grid", "message"), BAD_GRIDS, ids=[c[0] for c in BAD_GRIDS])
def test_bad_grid_files_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                             grid: dict[str, Any] | str, message: str) -> None:
    path = write_grid(tmp_path, grid)
    assert sweep_cli(tmp_path, path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gpupool simulate: error: --grid {path}: "), err
    assert message in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was made


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = write_grid(tmp_path, SMALL)
    assert sweep_cli(tmp_path, tmp_path / "missing.yaml") == 2
    assert "missing.yaml: cannot read: No such file or directory" in capsys.readouterr().err
    assert sweep_cli(tmp_path, grid, "--workers", "0") == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert sweep_cli(tmp_path, grid, "--traces-dir", str(tmp_path / "nope")) == 2
    assert "--traces-dir" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_ray_without_the_extra_says_to_install_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    assert sweep_cli(tmp_path, write_grid(tmp_path, SMALL), "--ray", "auto") == 2
    err = capsys.readouterr().err
    assert err == "gpupool simulate: error: --ray needs Ray (the 'ray' extra): pip install 'gpupool[ray]'\n"


def test_simulate_without_sub_command_is_unchanged() -> None:
    from gpupool_sched.simulate import cli, sweep_cli

    args = build_parser().parse_args(["simulate", "--policy", "fgd", "--ratio", "0.5"])
    assert args.func is cli.run and args.policy == "fgd" and args.simulate_command is None
    args = build_parser().parse_args(["simulate", "sweep", "--grid", "g.yaml", "--workers", "3"])
    assert args.func is sweep_cli.run and args.workers == 3


def test_the_rayjob_grid_and_entrypoint_are_a_valid_sweep(tmp_path: Path) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "deploy/ray/sweep-rayjob.yaml").read_text()) if d}
    grid = write_grid(tmp_path, docs["ConfigMap"]["data"]["grid.yaml"])
    assert len(load_grid(grid, None, "0.1.0").runs) == 10 * 7
    argv = docs["RayJob"]["spec"]["entrypoint"].split()
    assert argv[:3] == ["gpupool", "simulate", "sweep"]
    args = build_parser().parse_args(argv[1:])
    assert args.ray == "auto" and args.out == Path("/results")
    mounts = docs["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "volumeMounts"]
    assert {m["mountPath"] for m in mounts} >= {str(args.grid.parent), str(args.out)}


# ---- the time mode in a sweep ----------------------------------------------------------------------------
TIME_NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,131072,4,T4\n" for i in range(4))
TIME_PODS = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
             "scheduled_time\n" + "".join(f"p{i},2000,4096,{1 + i % 2},1000,,{('LS', 'BE')[i % 2]},Running,"
                                          f"{100 * i},{100 * i + 3600 + 60 * i},{100 * i + 5}\n" for i in range(12)))


def time_grid(tmp_path: Path, **parameters: Any) -> Path:
    (tmp_path / "nodes.csv").write_text(TIME_NODES)
    (tmp_path / "timed.csv").write_text(TIME_PODS)
    grid = {"traces": [{"nodes": "nodes.csv", "pods": "timed.csv"}], "seeds": [3], "policies": ["gpupool"],
            "parameters": {"mode": "time", "days": 0.5, "horizon_days": 1, **parameters}}
    return write_grid(tmp_path, grid)


def test_a_time_run_is_what_simulate_mode_time_reports(tmp_path: Path) -> None:
    runs = load_grid(time_grid(tmp_path, load=[0.7, 1.3], samples=20), None, "0.1.0").runs
    assert [(r.parameters.mode, r.parameters.load) for r in runs] == [("time", 0.7), ("time", 1.3)]
    results = [json.loads(run_one(r).result_json)["result"] for r in runs]
    assert main(["simulate", "--mode", "time", "--nodes", str(tmp_path / "nodes.csv"), "--pods",
                 str(tmp_path / "timed.csv"), "--load", "0.7,1.3", "--days", "0.5", "--horizon", "1", "--seed", "3",
                 "--json", str(tmp_path / "direct.json")]) == 0
    direct = json.loads((tmp_path / "direct.json").read_text())
    for result, expected in zip(results, direct, strict=True):
        for wall in ("seconds", "placement_seconds", "series"):
            expected.pop(wall)
        series = result.pop("series")
        assert result == expected
        assert len(series) == 20  # samples: the series over time, for plots
    assert results[0]["allocated_pct"] < results[1]["allocated_pct"]


def test_a_time_sweep_prints_its_table_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = time_grid(tmp_path, load=[0.7, 1.3])
    assert sweep_cli(tmp_path, grid, "--workers", "1") == 0
    out = capsys.readouterr().out
    assert "sweep, time mode" in out and "load=0.7" in out and "load=1.3" in out
    assert "unallocated % mean" not in out  # no arrivals run: no arrivals table
    counting = Counting()
    run_sweep(load_grid(grid, None, "0.1.0").runs, tmp_path / "out", counting)
    assert counting.ran == []  # every result is on disk already


def test_each_mode_takes_its_own_knobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # both modes in one grid: each point keeps the knobs of its mode, and no point is there twice
    mixed = dict(SMALL, parameters={"mode": ["arrivals", "time"], "ratio": [0.05, 0.1], "load": [0.8, 1.2]},
                 bound=True)
    runs = load_grid(write_grid(tmp_path, mixed), None, "0.1.0").runs
    points = {(r.seed, r.policy, repr(r.parameters.model_dump(exclude_defaults=True))) for r in runs}
    assert len(points) == len(runs)
    arrivals = [r for r in runs if r.parameters.mode == "arrivals"]
    timed = [r for r in runs if r.parameters.mode == "time"]
    assert {r.parameters.ratio for r in arrivals} == {0.05, 0.1} and {r.parameters.load for r in arrivals} == {1.0}
    assert {r.parameters.load for r in timed} == {0.8, 1.2} and {r.parameters.ratio for r in timed} == {1.3}
    assert len(timed) == 2 * 2 * 2  # seeds x loads x policies, and no bound: the time mode has none
    assert sum(r.policy == BOUND for r in arrivals) == 2 * 2  # seeds x ratios
    # one mode only: a knob of the other mode is refused, not ignored
    for parameters, message in (({"load": 0.8}, "load: not a parameter of mode arrivals"),
                                ({"mode": "time", "ratio": 0.5}, "ratio: not a parameter of mode time")):
        path = write_grid(tmp_path, dict(SMALL, parameters=parameters))
        assert sweep_cli(tmp_path, path) == 2
        assert message in capsys.readouterr().err


def test_a_time_sweep_takes_gangs_as_simulate_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = load_grid(time_grid(tmp_path, load=[1.3], gangs=["0.50:2"]), None, "0.1.0").runs
    assert [r.parameters.gangs for r in runs] == ["0.5:2"]  # one spelling, so one key
    [result] = [json.loads(run_one(r).result_json)["result"] for r in runs]
    assert main(["simulate", "--mode", "time", "--nodes", str(tmp_path / "nodes.csv"), "--pods",
                 str(tmp_path / "timed.csv"), "--load", "1.3", "--days", "0.5", "--horizon", "1", "--seed", "3",
                 "--gangs", "0.5:2", "--json", str(tmp_path / "direct.json")]) == 0
    [direct] = json.loads((tmp_path / "direct.json").read_text())
    for wall in ("seconds", "placement_seconds"):
        direct.pop(wall)
    assert result == direct and result["gangs"]["arrived"] > 0
    for gangs, message in ((1.8, "write SHARE:SIZE as a quoted string"), ("2:4", "SHARE must be in (0, 1]")):
        path = write_grid(tmp_path, dict(SMALL, parameters={"mode": "time", "gangs": gangs}))
        assert sweep_cli(tmp_path, path) == 2
        assert message in capsys.readouterr().err
