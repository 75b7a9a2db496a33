"""`gpupool dev-cluster` as a person uses it: bad input gives one clear line and exit code 2, never a
traceback; add-nodes and status report what they did."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpupool_devcluster.client import ClusterClient

GPUPOOL = Path(sys.executable).parent / "gpupool"  # the console script of this environment


def _gpupool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GPUPOOL), *args], capture_output=True, text=True, timeout=120, check=False)


def _one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(("args", "fragments"), [
    (["--profile", "no-such-gpu", "--count", "1"], ["no-such-gpu", "dgx-h100"]),
    (["--profile", "dgx-h100", "--count", "0"], ["--count must be at least 1"]),
    (["--profile", "dgx-h100", "--count", "-5"], ["--count must be at least 1"]),
    (["--profile", "dgx-h100", "--count", "1", "--prefix", "Bad_Prefix"], ["bad node name prefix"]),
])
def test_add_nodes_rejects_bad_input_in_one_line(kube: ClusterClient, args: list[str],
                                                 fragments: list[str]) -> None:
    before = len(kube.core.list_node().items)
    _one_line_error(_gpupool("dev-cluster", "add-nodes", "--name", kube.cluster.name, *args), *fragments)
    assert len(kube.core.list_node().items) == before  # nothing was created


def test_commands_on_a_cluster_that_is_not_running_say_so() -> None:
    name = f"absent-{uuid.uuid4().hex[:6]}"
    _one_line_error(
        _gpupool("dev-cluster", "add-nodes", "--name", name, "--profile", "dgx-h100", "--count", "1"),
        f"dev cluster '{name}' is not running", "gpupool dev-cluster up --name")
    _one_line_error(_gpupool("dev-cluster", "kubeconfig", "--name", name), "is not running")
    status = _gpupool("dev-cluster", "status", "--name", name)
    assert status.returncode == 1 and "is not running" in status.stderr


def test_bad_cluster_name_is_refused() -> None:
    _one_line_error(_gpupool("dev-cluster", "up", "--name", "Not_A_Name"), "bad cluster name")


def test_add_nodes_then_status_report_the_nodes(kube: ClusterClient) -> None:
    prefix = f"cli-{uuid.uuid4().hex[:6]}-"
    result = _gpupool("dev-cluster", "add-nodes", "--name", kube.cluster.name, "--profile", "nvlink-pairs",
                      "--count", "3", "--prefix", prefix)
    assert result.returncode == 0, result.stderr
    # the result on stdout, the progress (a counter line off a terminal) on stderr (issue 22, items 3-4)
    assert "3 nvlink-pairs nodes Ready" in result.stdout and f"{prefix}0000 .. {prefix}0002" in result.stdout
    assert "created 3/3" in result.stderr and "Ready 3/3" in result.stderr
    again = _gpupool("dev-cluster", "add-nodes", "--name", kube.cluster.name, "--profile", "nvlink-pairs",
                     "--count", "1", "--prefix", prefix)
    assert f"{prefix}0003" in again.stdout  # indices continue after the highest one in use
    kube.created_nodes.extend(f"{prefix}{i:04d}" for i in range(4))  # cleaned up with the session

    status = json.loads(_gpupool("dev-cluster", "status", "--name", kube.cluster.name, "--json").stdout)
    assert status["running"] and status["server"] == kube.server
    assert status["nodes"] >= 4
    assert {p["name"] for p in status["processes"] if p["alive"]} >= {"etcd", "kube-apiserver", "kwok"}


def test_no_wait_says_what_it_did_and_delete_nodes_reports_on_stdout(kube: ClusterClient) -> None:
    """`add-nodes --no-wait` used to return silently; `delete-nodes --prefix ''` deleted every fake node
    without a word (issue 22, item 3)."""
    prefix = f"nowait-{uuid.uuid4().hex[:6]}-"
    kube.created_nodes.extend(f"{prefix}{i:04d}" for i in range(2))
    result = _gpupool("dev-cluster", "add-nodes", "--name", kube.cluster.name, "--profile", "dgx-h100",
                      "--count", "2", "--prefix", prefix, "--no-wait")
    assert result.returncode == 0, result.stderr
    assert "2 dgx-h100 nodes created" in result.stdout
    assert "not waiting for them to be Ready (--no-wait)" in result.stdout
    assert "created 2/2" in result.stderr and "Ready" not in result.stderr
    before = len(kube.core.list_node().items)
    _one_line_error(_gpupool("dev-cluster", "delete-nodes", "--name", kube.cluster.name, "--prefix", ""),
                    "--prefix '' would delete every fake node", "--all")
    assert len(kube.core.list_node().items) == before
    deleted = _gpupool("dev-cluster", "delete-nodes", "--name", kube.cluster.name, "--prefix", prefix)
    assert deleted.returncode == 0, deleted.stderr
    assert f"deleted 2 fake node(s) named {prefix}*" in deleted.stdout
    again = _gpupool("dev-cluster", "delete-nodes", "--name", kube.cluster.name, "--prefix", prefix)
    assert f"no fake node named {prefix}* to delete" in again.stdout
