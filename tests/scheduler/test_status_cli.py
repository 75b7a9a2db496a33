"""`gpupool status` / `kubectl-gpupool status` errors: one line on stderr, exit 2 (no control plane needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kubeconfigs import token_kubeconfig
from tests.support.ports import free_port

BIN = Path(sys.executable).parent
SCRIPTS = {"gpupool": "gpupool status", "kubectl-gpupool": "kubectl gpupool status"}


def run(script: str, *args: str, kubeconfig_env: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    if kubeconfig_env is not None:
        env["KUBECONFIG"] = str(kubeconfig_env)
    return subprocess.run([str(BIN / script), "status", *args], capture_output=True, text=True, timeout=60, env=env)


def one_error_line(result: subprocess.CompletedProcess[str], prog: str) -> str:
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_unreachable_api_server(tmp_path: Path, script: str) -> None:
    server = f"https://127.0.0.1:{free_port()}"
    line = one_error_line(run(script, "--kubeconfig", str(token_kubeconfig(tmp_path, server))), SCRIPTS[script])
    assert f"cannot reach the API server at {server}" in line
    assert "Connection refused" in line


def test_unreachable_api_server_from_env(tmp_path: Path) -> None:
    server = f"https://127.0.0.1:{free_port()}"
    done = run("kubectl-gpupool", kubeconfig_env=token_kubeconfig(tmp_path, server))  # as kubectl runs a plugin
    line = one_error_line(done, SCRIPTS["kubectl-gpupool"])
    assert f"cannot reach the API server at {server}" in line


@pytest.mark.parametrize(("args", "words"), [
    (["--kubeconfig", "/does/not/exist"], "kubeconfig /does/not/exist does not exist"),
    ([], "no cluster: give --kubeconfig, set $KUBECONFIG, or run in a pod"),
    (["--output", "yaml"], "invalid choice: 'yaml'"),
    (["--memory-unit-mib", "0"], "must be positive"),
])
def test_bad_input(args: list[str], words: str) -> None:
    for script, prog in SCRIPTS.items():
        assert words in one_error_line(run(script, *args), prog)


def test_unknown_flag() -> None:
    for script, prog in SCRIPTS.items():  # the sub-command it was given to reports it (issue 22, item 4)
        line = one_error_line(run(script, "--bogus"), prog)
        assert "unrecognized arguments: --bogus" in line


def test_kubectl_plugin_offers_status_only() -> None:
    done = subprocess.run([str(BIN / "kubectl-gpupool"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "status" in done.stdout and "scheduler" not in done.stdout
    bad = subprocess.run([str(BIN / "kubectl-gpupool"), "scheduler"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'scheduler'" in bad.stderr
