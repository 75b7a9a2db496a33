"""`gpupool simulate sweep --ray`: the same grid run in local processes and as tasks on a private Ray head
(127.0.0.1, 2 CPUs, workers importing this checkout) writes byte-identical result files, and a second
sweep on Ray skips them all. Ray (the `ray` extra) is part of `dev`: without it this module fails to import,
it is never skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray  # noqa: F401  (the dev install holds it; a missing ray fails here, loudly)
import yaml

from gpupool_sched.cli import main

GRID = {"traces": ["default"], "seeds": [3, 4], "policies": ["fgd", "gpupool"], "parameters": {"ratio": 0.1}}


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    from tests.support.ray_head import ray_head

    with ray_head(num_cpus=2) as address:
        yield address


def test_ray_and_local_processes_write_identical_results(tmp_path: Path, ray_address: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(local), "--workers", "2"]) == 0
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(on_ray), "--ray", ray_address]) == 0
    assert "sweep: 4 runs, 0 finished before (skipped), 4 run now" in capsys.readouterr().out
    names = sorted(p.name for p in (local / "runs").iterdir())
    assert len(names) == 4
    assert sorted(p.name for p in (on_ray / "runs").iterdir()) == names
    for name in names:
        assert (on_ray / "runs" / name).read_bytes() == (local / "runs" / name).read_bytes(), name
    # run again on Ray: nothing is sent to the cluster
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(on_ray), "--ray", ray_address]) == 0
    assert "sweep: 4 runs, 4 finished before (skipped), 0 run now" in capsys.readouterr().out


def test_an_unreachable_ray_address_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.ports import free_port

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(dict(GRID, seeds=[5])))
    address = f"127.0.0.1:{free_port()}"
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(tmp_path / "o"), "--ray", address]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpupool simulate: error: --ray {address}: cannot connect to the Ray cluster")
    assert err.count("\n") == 1, err
