"""The plugin survives its inputs: injected events, a second plugin, flags, config and profile files.

No Kubernetes control plane: the plugin runs with `kubernetes.mode: disabled` against the kubelet stand-in.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import yaml

from gpupool_deviceplugin.config import HealthConfig
from gpupool_deviceplugin.daemon import LOCK_FILE, KubeletDirLock, StartupError
from gpupool_deviceplugin.health import HealthMonitor
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.nvml.fake import FakeNvml
from gpupool_deviceplugin.nvml.session import HealthEvent
from gpupool_deviceplugin.publication import node_publication_for_profile
from tests.support.kubelet_standin import KubeletStandin
from tests.support.plugin_process import plugin_command

FAST = {"health": {"recoveryQuietPeriodSeconds": 0, "eventWaitMs": 50}}
MALFORMED = [
    b"this is not JSON",
    b"[1, 2, 3]",
    b'{"uuid": 17, "xid": 79}',
    b'{"xid": 79}',
    b'{"uuid": "GPU-0", "event": "meltdown"}',
    b"\xff\xfe binary \x00 garbage",
    b"[" * 100_000,
]


def uuids(profile: str, node: str = "node-a") -> list[str]:
    return [g.uuid for g in node_publication_for_profile(profile, node_name=node).inventory.gpus]


def run_plugin(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "LOG_LEVEL")}
    return subprocess.run([*plugin_command(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


# -- fake NVML events ------------------------------------------------------------------------------

def test_fake_nvml_skips_malformed_event_lines_naming_them(tmp_path: Path, caplog) -> None:
    events = tmp_path / "ev.jsonl"
    events.write_bytes(b'{"old": "history before start-up is not replayed"}\n')
    fake = FakeNvml("l40s-pcie", events_file=events)
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    for i in range(4):
        fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, es)
    gpu2 = fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(2))
    bad_xid = f'{{"uuid": "{gpu2}", "xid": "lots"}}'.encode()
    unknown = b'{"uuid": "GPU-00000000-0000-0000-0000-000000000000", "xid": 79}'
    with events.open("ab") as fh:
        fh.write(b"\n".join([*MALFORMED, bad_xid, unknown, f'{{"uuid": "{gpu2}", "xid": 79}}'.encode()]) + b"\n")
    with caplog.at_level(logging.WARNING, logger="gpupool_deviceplugin.nvml.fake"):
        event = fake.nvmlEventSetWait_v2(es, 1000)
    assert fake.nvmlDeviceGetUUID(event.device) == gpu2 and event.eventData == 79
    with pytest.raises(pynvml.NVMLError_Timeout):  # nothing else came out of the bad lines
        fake.nvmlEventSetWait_v2(es, 50)
    ignored = [r.getMessage() for r in caplog.records if "line ignored" in r.getMessage()]
    assert len(ignored) == len(MALFORMED) + 2
    assert f"{events}:2: not a JSON object" in ignored[0]  # line numbers count the lines before start-up
    assert "no GPU or MIG device 'GPU-00000000-0000-0000-0000-000000000000'" in ignored[-1]
    assert all(fake.nvmlDeviceGetMemoryInfo(fake.nvmlDeviceGetHandleByIndex(i)) for i in range(4))  # none lost


def test_malformed_event_lines_do_not_stop_health_monitoring(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("l40s-pcie", config=FAST)
    kubelet.wait_registered({"nvidia.com/gpu"})
    gpus = uuids("l40s-pcie")
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    watch.wait(lambda lst: len(lst.healthy()) == 4)
    with plugin.events.open("ab") as fh:
        fh.write(b"\n".join(MALFORMED) + b"\n")
    plugin.wait_log(r"nvml-events\.jsonl:7: not a JSON object")
    plugin.inject(uuid=gpus[1], xid=79)  # after the garbage: still seen
    watch.wait(lambda lst: lst.unhealthy() == {gpus[1]})
    assert plugin.proc.poll() is None
    watch.close()


def test_an_event_for_an_unknown_uuid_touches_no_other_gpu(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("dgx-h100", config=FAST)
    kubelet.wait_registered({"nvidia.com/gpu"})
    gpus = uuids("dgx-h100")
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    watch.wait(lambda lst: len(lst.healthy()) == 8)
    plugin.inject(uuid=uuids("dgx-h100", node="some-other-node")[0], xid=79)
    plugin.inject(uuid="GPU-does-not-exist", event="double_bit_ecc")
    plugin.inject(uuid=gpus[5], xid=48)  # a marker behind them
    watch.wait(lambda lst: lst.unhealthy() == {gpus[5]})
    assert all(lst.unhealthy() <= {gpus[5]} for lst in watch.lists), "an unknown UUID marked other GPUs"
    assert "no GPU or MIG device 'GPU-does-not-exist' on this node" in plugin.log()
    watch.close()


def test_health_monitoring_outlives_an_unexpected_error() -> None:
    """Whatever escapes one step (a bug, a driver surprise) is logged; the next event is still handled."""
    marked: list[str] = []
    queue: list[object] = [RuntimeError("boom"), HealthEvent("GPU-a", pynvml.nvmlEventTypeXidCriticalError, 79,
                                                             None, None)]

    class Session:
        def handle_by_uuid(self, uuid: str) -> str:
            return uuid

        def create_event_set(self, handles: list[str]) -> tuple[object, list[str]]:
            return object(), []

        def wait_event(self, event_set: object, timeout_ms: int) -> HealthEvent | None:
            if not queue:
                time.sleep(timeout_ms / 1000)
                return None
            item = queue.pop(0)
            if isinstance(item, Exception):
                raise item
            return item  # type: ignore[return-value]

        def free_event_set(self, event_set: object) -> None:
            pass

        def probe(self, uuid: str) -> None:
            return None

    gpu = SimpleNamespace(uuid="GPU-a", index=0, mig_devices=())
    inventory = SimpleNamespace(gpus=[gpu], gpu_by_uuid=lambda u: gpu if u == "GPU-a" else None)
    board = SimpleNamespace(mark_unhealthy=lambda uuid, reason: marked.append(uuid) or True)
    monitor = HealthMonitor(Session(), inventory, board, HealthConfig(eventWaitMs=10, recoveryQuietPeriodSeconds=0),
                            PluginMetrics())
    monitor.start()
    try:
        deadline = time.monotonic() + 5
        while not marked and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marked == ["GPU-a"]
    finally:
        monitor.stop()


# -- one plugin per kubelet directory -------------------------------------------------------------

def test_the_kubelet_directory_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    first = KubeletDirLock.acquire(tmp_path, "node-a")
    with pytest.raises(StartupError, match=rf"another gpupool device plugin \(pid {os.getpid()}, node node-a\)"):
        KubeletDirLock.acquire(tmp_path, "node-b")
    first.release()
    KubeletDirLock.acquire(tmp_path, "node-b").release()
    assert (tmp_path / LOCK_FILE).exists()  # kept: deleting it would let two processes lock two files


def test_a_second_plugin_on_the_same_kubelet_dir_refuses_to_start(kubelet: KubeletStandin, kubelet_dir: Path,
                                                                   start_plugin, tmp_path: Path) -> None:
    first = start_plugin("l40s-pcie")
    kubelet.wait_registered({"nvidia.com/gpu"})
    sockets = sorted(p.name for p in kubelet_dir.glob("gpupool-*.sock"))
    inodes = {p.name: p.stat().st_ino for p in kubelet_dir.glob("gpupool-*.sock")}
    config = tmp_path / "second.yaml"
    config.write_text("metrics: {port: 0, bindAddress: 127.0.0.1}\nkubernetes: {mode: disabled}\n")
    second = run_plugin("--fake-nvml", "l40s-pcie", "--node-name", "node-b", "--kubelet-dir", str(kubelet_dir),
                        "--config", str(config))
    assert second.returncode == 2, second.stderr
    assert f"another gpupool device plugin (pid {first.proc.pid}, node node-a)" in second.stderr
    assert "Traceback" not in second.stderr
    assert {p.name: p.stat().st_ino for p in kubelet_dir.glob("gpupool-*.sock")} == inodes, "live sockets touched"
    assert sorted(p.name for p in kubelet_dir.glob("gpupool-*.sock")) == sockets
    watch = kubelet.plugin("nvidia.com/gpu").watch()  # the first one still serves
    assert len(watch.latest().devices) == 4
    watch.close()
    assert first.proc.poll() is None
    first.stop()
    third = start_plugin("l40s-pcie", node="node-c")  # released on exit
    third.wait_log(r"gpupool device plugin running on node node-c")


# -- bad command lines and files: one line, exit 2 -------------------------------------------------

@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


BINARY = bytes(range(256)) * 4


@pytest.mark.parametrize(("case", "message"), [
    ("log-level", "unknown log level 'LOUD'"),
    ("env-log-level", "unknown log level 'verbose'"),
    ("port-high", "--metrics-port must be 0..65535 (0: off), got 70000"),
    ("port-negative", "--metrics-port must be 0..65535 (0: off), got -1"),
    ("port-in-use", "cannot serve metrics on 127.0.0.1:{port}: Address already in use"),
    ("config-dir", "invalid configuration: config file {tmp} is a directory, not a YAML file"),
    ("config-binary", "invalid configuration: config file {tmp}/blob.bin is not UTF-8 text"),
    ("config-yaml-syntax", "invalid configuration: config file {tmp}/broken.yaml is not valid YAML: line 2"),
    ("profile-dir", "fake NVML profile {tmp} is a directory, not a YAML file"),
    ("profile-binary", "fake NVML profile {tmp}/blob.yaml is not UTF-8 text"),
    ("profile-binary-no-suffix", "fake NVML profile {tmp}/blob.bin is not UTF-8 text"),
    ("events-dir", "fake NVML events file {tmp} is not a regular file"),
    ("config-mps-relative", "field gpuMemory.mpsShmDirectory: Value error, an absolute host path, got 'shm'"),
    ("config-mps-no-pipe", "field gpuMemory.mpsPipeDirectory: Value error, MPS clients need the daemon's pipe"),
    ("idle-threshold", "invalid configuration: --idle-threshold: Input should be less than or equal to 100"),
    ("idle-window", "invalid configuration: --idle-window: Input should be greater than 0"),
    ("config-idle", "field idle.startGraceSeconds: Input should be greater than or equal to 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, kubelet_dir: Path, busy_port: int, case: str,
                                          message: str) -> None:
    (tmp_path / "blob.bin").write_bytes(BINARY)
    (tmp_path / "blob.yaml").write_bytes(BINARY)
    (tmp_path / "broken.yaml").write_text("metrics: {port: 1\n")
    good = tmp_path / "good.yaml"
    good.write_text("metrics: {port: 0, bindAddress: 127.0.0.1}\nkubernetes: {mode: disabled}\n")
    args = {"--fake-nvml": "l40s-pcie", "--kubelet-dir": str(kubelet_dir), "--config": str(good),
            "--log-level": "WARNING"}
    env: dict[str, str] = {}
    match case:
        case "log-level":
            args["--log-level"] = "LOUD"
        case "env-log-level":
            del args["--log-level"]
            env["LOG_LEVEL"] = "verbose"
        case "port-high":
            args["--metrics-port"] = "70000"
        case "port-negative":
            args["--metrics-port"] = "-1"
        case "port-in-use":
            args["--metrics-port"] = str(busy_port)
        case "config-dir":
            args["--config"] = str(tmp_path)
        case "config-binary":
            args["--config"] = str(tmp_path / "blob.bin")
        case "config-yaml-syntax":
            args["--config"] = str(tmp_path / "broken.yaml")
        case "profile-dir":
            args["--fake-nvml"] = str(tmp_path)
        case "profile-binary":
            args["--fake-nvml"] = str(tmp_path / "blob.yaml")
        case "profile-binary-no-suffix":
            args["--fake-nvml"] = str(tmp_path / "blob.bin")
        case "events-dir":
            args["--fake-nvml-events"] = str(tmp_path)
        case "idle-threshold":
            args["--idle-threshold"] = "150"
        case "idle-window":
            args["--idle-window"] = "0"
        case "config-idle":
            args["--config"] = str(tmp_path / "idle.yaml")
            (tmp_path / "idle.yaml").write_text(good.read_text() + "idle: {startGraceSeconds: -1}\n")
        case "config-mps-relative" | "config-mps-no-pipe":
            mps = "{mps: true, mpsShmDirectory: shm}" if case == "config-mps-relative" else '{mpsPipeDirectory: ""}'
            args["--config"] = str(tmp_path / "mps.yaml")
            (tmp_path / "mps.yaml").write_text(good.read_text() + f"gpuMemory: {mps}\n")
    result = run_plugin(*(x for kv in args.items() for x in kv), env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpupool-deviceplugin: ")
    assert message.format(port=busy_port, tmp=tmp_path) in lines[0]
    assert not list(kubelet_dir.glob("*.sock"))


# -- the README's command -------------------------------------------------------------------------

def test_the_readme_command_runs_without_kubelet_or_api_server(tmp_path: Path, kubelet_dir: Path) -> None:
    """`gpupool-deviceplugin --node-name n1 --fake-nvml dgx-h100 --kubelet-dir /tmp/kubelet` on a fresh
    machine: a missing directory is one line saying what to do; with it, the plugin runs and waits for a
    kubelet, without an API server. (--metrics-port 0, off, only because 9402 may be taken on a test machine.)"""
    fresh = kubelet_dir / "kubelet"
    command = ["--node-name", "n1", "--fake-nvml", "dgx-h100", "--kubelet-dir", str(fresh), "--metrics-port", "0"]
    missing = run_plugin(*command)
    assert missing.returncode == 2 and f"mkdir -p {fresh}" in missing.stderr
    fresh.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "LOG_LEVEL")}
    log = tmp_path / "plugin.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*plugin_command(), *command], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while "waiting for the kubelet" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        text = log.read_text()
        assert "waiting for the kubelet" in text and "no API server" in text, text
        assert (fresh / "gpupool-gpu.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert not (fresh / "gpupool-gpu.sock").exists()


# -- an unreachable API server, a relative kubelet directory (issue 22) ----------------------------------

def test_an_unreachable_api_server_is_logged_once_per_state_change(tmp_path: Path, kubelet_dir: Path,
                                                                   start_plugin) -> None:
    """The plugin logged 50 lines in 20 s while the API server was unreachable: three urllib3 `Retrying`
    warnings per request and one warning per attempt of the pod watch and the node publication. Now each
    retried call says once that it fails and retries with back-off."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    plugin = start_plugin("l40s-pcie", kubeconfig=kubeconfig, config={"kubernetes": {"mode": "auto"}})
    plugin.wait_log(r"pod watch for node node-a failed")
    time.sleep(6)  # pod watch retries after 0.5, 1, 2 and 4 s
    log_text = plugin.log()
    assert "Retrying" not in log_text and "urllib3" not in log_text, log_text
    failures = [line for line in log_text.splitlines() if "pod watch for node node-a failed" in line]
    assert len(failures) == 1, log_text
    assert "Connection refused; retrying with back-off" in failures[0], failures[0]


def test_retry_log_warns_once_per_cause_and_says_when_it_recovers(caplog: pytest.LogCaptureFixture) -> None:
    from gpupool_deviceplugin.kube.retrylog import RetryLog

    retry = RetryLog(logging.getLogger("test.retry"), "pod watch for node n")
    refused = ConnectionRefusedError(111, "Connection refused")
    with caplog.at_level(logging.DEBUG, logger="test.retry"):
        for _ in range(5):
            retry.failed(refused, 1.0)
        retry.failed(TimeoutError("timed out"), 2.0)
        retry.succeeded()
        retry.succeeded()
        retry.failed(refused, 1.0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "DEBUG", "DEBUG", "DEBUG", "DEBUG", "WARNING", "INFO",
                                             "WARNING"], lines
    assert lines[6][1] == "pod watch for node n works again after 6 failed attempt(s)"


def test_a_relative_kubelet_dir_is_served(tmp_path: Path) -> None:
    """`--kubelet-dir kd` gave a traceback from gRPC (unix:// takes no relative path)."""
    (tmp_path / "kd").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "LOG_LEVEL")}
    log = tmp_path / "plugin.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*plugin_command(), "--node-name", "n1", "--fake-nvml", "l40s-pcie", "--kubelet-dir",
                                 "kd", "--metrics-port", "0"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while "waiting for the kubelet" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert (tmp_path / "kd" / "gpupool-gpu.sock").exists(), log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
