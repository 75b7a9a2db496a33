"""Bad input a new user tried across the commands (issue 22), checked without a cluster: each is one line
and exit code 2 before anything is touched, and the help shows what the user needs to choose well."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpupool_sched.cli as gpupool_cli


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpupool_cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def one_line(argv: list[str], *words: str) -> str:
    code, _, err = run(argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connecting to a cluster fails the test: these inputs must be refused before."""
    from gpupool_devcluster.client import ClusterClient

    def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("connected to the cluster before the input was checked")

    monkeypatch.setattr(ClusterClient, "connect", connect)


# -- item 3: dev tools with limits -----------------------------------------------------------------

@pytest.mark.parametrize(("argv", "words"), [
    (["add-nodes", "--profile", "dgx-h100", "--count", "100000000", "--no-wait"],
     ["--count must be at most 5000 per call", "not 100000000"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "5001"], ["--count must be at most 5000"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "10", "--concurrency", "0"],
     ["--concurrency must be in 1..256"]),
    (["add-nodes", "--profile", "dgx-h100", "--count", "10", "--concurrency", "100000"],
     ["--concurrency must be in 1..256"]),
    (["delete-nodes", "--prefix", ""], ["--prefix '' would delete every fake node", "--all"]),
    (["delete-nodes", "--prefix", "x", "--all"], ["not allowed with argument"]),
    (["delete-nodes"], ["one of the arguments --prefix --all is required"]),
    (["delete-nodes", "--all", "--concurrency", "-1"], ["--concurrency must be in 1..256"]),
])
def test_dev_cluster_bounds_are_checked_first(no_cluster, argv: list[str], words: list[str]) -> None:
    one_line(["dev-cluster", *argv, "--name", "never-started"], *words)


@settings(max_examples=50, deadline=None)
@given(count=st.integers(min_value=5001, max_value=10**30))
def test_any_count_over_the_cap_is_refused_before_connecting(count: int) -> None:
    from gpupool_devcluster.client import ClusterClient

    real = ClusterClient.connect
    ClusterClient.connect = None  # type: ignore[assignment,method-assign]  # any use fails
    try:
        one_line(["dev-cluster", "add-nodes", "--profile", "dgx-h100", "--count", str(count)], "at most 5000")
    finally:
        ClusterClient.connect = real  # type: ignore[method-assign]


def test_the_cap_is_in_the_help() -> None:
    code, out, _ = run(["dev-cluster", "add-nodes", "--help"])
    text = " ".join(out.split())
    assert code == 0 and "1..5000 per call" in text and "without waiting for kwok to make them Ready" in text
    code, out, _ = run(["dev-cluster", "delete-nodes", "--help"])
    assert code == 0 and "--all" in out
