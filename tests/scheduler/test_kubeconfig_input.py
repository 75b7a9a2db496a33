"""A malformed kubeconfig is one line naming the file and the problem, exit 2, no traceback, in every
command that reads one: `gpupool scheduler`, `status`, `extender` and `gpupool-deviceplugin` (issue 22,
item 2: only the client's ConfigException was caught; garbage YAML gave yaml.ScannerError, a bare string or
a list a TypeError, a binary file a UnicodeDecodeError)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool_common.kubeconfig import KubeconfigError, load_kubeconfig, read_kubeconfig

COMMANDS = {
    "scheduler": [sys.executable, "-m", "gpupool_sched"],
    "status": [sys.executable, "-m", "gpupool_sched.cli", "status"],
    "extender": [sys.executable, "-m", "gpupool_sched.cli", "extender", "--port", "1"],
    "deviceplugin": [sys.executable, "-m", "gpupool_deviceplugin.cli", "--fake-nvml", "l40s-pcie",
                     "--metrics-port", "0"],
}
GOOD = {
    "apiVersion": "v1", "kind": "Config", "current-context": "c",
    "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
}
# (file content, what the one line must say)
MALFORMED = {
    "garbage-yaml": (b"a: [b\n  : c: d:", "is not valid YAML: line 2, column 3"),
    "bare-string": (b'"just a string"\n', "is a string, not a kubeconfig"),
    "list": (b"- a\n- b\n", "is a list, not a kubeconfig"),
    "number": (b"42\n", "is a number, not a kubeconfig"),
    "empty": (b"", "is empty, not a kubeconfig"),
    "binary": (b"apiVersion: v1\n\xff\xfe\x00\x83garbage", "is not UTF-8 text at line 2, column 1: byte 0xff"),
    "clusters-string": (b"clusters: abc\n", "clusters is a string, not a list"),
    "clusters-of-strings": (b"clusters: [a, b]\n", "clusters[0] is not a mapping with a name"),
    "context-string": (yaml.safe_dump({**GOOD, "contexts": [{"name": "c", "context": "x"}]}).encode(),
                       "contexts[0].context is a string, not a mapping"),
    "no-current-context": (yaml.safe_dump({k: v for k, v in GOOD.items() if k != "current-context"}).encode(),
                           "cannot use kubeconfig"),
    "bad-ca-data": (yaml.safe_dump({**GOOD, "clusters": [{"name": "c", "cluster": {
        "server": "https://127.0.0.1:1", "certificate-authority-data": "!!notbase64"}}]}).encode(),
                    "cannot use kubeconfig"),
}


def run(command: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "LOG_LEVEL")}
    extra = ["--kubelet-dir", str(cwd)] if command == "deviceplugin" else []
    return subprocess.run([*COMMANDS[command], *extra, *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=cwd)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_kubeconfig_is_one_line_naming_the_file(tmp_path: Path, command: str, case: str) -> None:
    content, words = MALFORMED[case]
    path = tmp_path / "kubeconfig"
    path.write_bytes(content)
    done = run(command, "--kubeconfig", str(path), cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert f"kubeconfig {path}" in lines[0] and words in lines[0], lines[0]


def test_a_directory_or_unreadable_kubeconfig_says_so(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match=f"kubeconfig {tmp_path} is a directory"):
        read_kubeconfig(tmp_path)
    with pytest.raises(KubeconfigError, match="does not exist"):
        read_kubeconfig(tmp_path / "nope")


def test_a_good_kubeconfig_loads(tmp_path: Path) -> None:
    from kubernetes import client

    (tmp_path / "k").write_text(yaml.safe_dump(GOOD))
    cfg = client.Configuration()
    load_kubeconfig(tmp_path / "k", client_configuration=cfg)
    assert cfg.host == "https://127.0.0.1:1"


# -- fuzz: any bytes, any YAML document, give a loaded config or one KubeconfigError line --------------

LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.text(max_size=5),
                 st.sampled_from(["c", "u", "https://127.0.0.1:1", "!!", "Zm9v"]))
# no exec or auth-provider: the client would run the drawn command
KEYS = st.sampled_from(["name", "cluster", "context", "user", "server", "token", "certificate-authority-data",
                        "client-key", "current-context", "clusters", "contexts", "users",
                        "insecure-skip-tls-verify", "x"])
DOC = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                 st.dictionaries(KEYS, inner, max_size=4)), max_leaves=12)


@st.composite
def kubeconfigs(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return draw(st.text(max_size=200)).encode()
    doc = draw(DOC)
    if kind == 3:  # mostly a kubeconfig, one part replaced
        doc = dict(GOOD)
        doc[draw(st.sampled_from(sorted(GOOD)))] = draw(DOC)
    return yaml.safe_dump(doc).encode()


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=kubeconfigs())
def test_random_kubeconfigs_load_or_give_one_line(content: bytes) -> None:
    from kubernetes import client

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kubeconfig"
        path.write_bytes(content)
        try:
            load_kubeconfig(path, client_configuration=client.Configuration())
        except KubeconfigError as exc:  # anything else escapes and fails the test
            assert str(exc).startswith((f"kubeconfig {path}", f"cannot use kubeconfig {path}"))
            assert "\n" not in str(exc)


@pytest.mark.parametrize("command", ["scheduler", "status", "extender"])
def test_an_unreachable_api_server_is_one_line_without_retry_warnings(tmp_path: Path, command: str) -> None:
    """The extender printed three urllib3 `Retrying...` warnings before its clear error (issue 22, item 7)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({**GOOD, "clusters": [{"name": "c", "cluster": {
        "server": f"https://127.0.0.1:{port}"}}]}))
    done = run(command, "--kubeconfig", str(path), cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"cannot reach the API server at https://127.0.0.1:{port}" in lines[0] and "Retrying" not in done.stderr
