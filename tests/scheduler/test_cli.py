"""`gpupool scheduler` / `python -m gpupool_sched` start-up errors: one line on stderr, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kubeconfigs import token_kubeconfig
from tests.support.ports import free_port


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupool_sched", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "words"), [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--metrics-port", "70000"], "outside 0..65535"),
    (["--policy", "nope"], "invalid choice"),
    (["--percentage-of-nodes-to-score", "101"], "outside 0..100"),
    (["--gate-timeout", "-1"], "must be positive"),
    (["--max-checkpoint-grace", "0"], "must be positive"),
    (["--max-checkpoint-grace", "1.5"], "not a int"),
    (["--nomination-slack", "-5"], "must be positive"),
    (["--kubeconfig", "/does/not/exist"], "does not exist"),
    (["--kubeconfig", "/dev/null", "--leader-elect", "--retry-period", "20"], "--retry-period < --renew-deadline"),
    (["--preemption-min-candidate-nodes-percentage", "101"], "outside 0..100"),
    (["--preemption-min-candidate-nodes-absolute", "-1"], "must be"),
    (["--preemption-search-budget-ms", "0"], "must be positive"),
    (["--kubeconfig", "/dev/null", "--preemption-min-candidate-nodes-percentage", "0",
      "--preemption-min-candidate-nodes-absolute", "0"], "cannot both be 0"),
    (["--idle-reclaim-action", "evict"], "invalid choice"),
    (["--idle-after", "soon"], "'soon' is not a duration"),
    (["--idle-reclaim-budget", "-1"], "must be"),
    (["--elastic", "maybe"], "invalid choice"),
    (["--elastic-no-flap", "-1"], "must be"),
])
def test_bad_flags(args: list[str], words: str) -> None:
    assert words in one_error_line(run(*args))


def test_idle_after_takes_seconds_or_a_duration() -> None:
    import argparse

    from gpupool_sched.scheduler.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--idle-after", "90"]).idle_after == 90.0
    assert parser.parse_args(["--idle-after", "1h30m"]).idle_after == 5400.0
    assert parser.parse_args([]).idle_after == 3600.0
    assert parser.parse_args([]).idle_reclaim_action == "none"


def test_unreachable_api_server(tmp_path: Path) -> None:
    server = f"https://127.0.0.1:{free_port()}"
    line = one_error_line(run("--kubeconfig", str(token_kubeconfig(tmp_path, server)), "--metrics-port", "0"))
    assert f"cannot reach the API server at {server}" in line


def test_no_cluster_configured(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    assert "no cluster" in one_error_line(run(env=env))


def test_gpupool_cli_has_the_scheduler() -> None:
    result = subprocess.run([sys.executable, "-m", "gpupool_sched.cli", "scheduler", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--leader-elect" in result.stdout
