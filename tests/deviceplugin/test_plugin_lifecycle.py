"""Start-up, kubelet restarts, stale sockets, bad input: the plugin process against the kubelet stand-in."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.kubelet_standin import KubeletStandin
from tests.support.plugin_process import PluginProcess, plugin_command

MIG_RESOURCES = {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"}


def test_kubelet_restart_reregisters_every_resource_within_5s(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("a100-mig")
    kubelet.wait_registered(MIG_RESOURCES)
    for round_ in range(2):
        recreated = kubelet.restart()  # deletes every socket, then serves a new kubelet.sock
        regs = kubelet.wait_registered(MIG_RESOURCES, since=recreated, timeout=5.0)
        worst = max(r.at for r in regs.values()) - recreated
        assert worst < 5.0, f"round {round_}: re-registration took {worst:.2f}s"
        for reg in regs.values():  # re-served: the sockets exist again and answer
            assert (kubelet.directory / reg.endpoint).exists()
        watch = kubelet.plugin("nvidia.com/mig-1g.10gb").watch()
        assert len(watch.wait(lambda lst: len(lst.devices) == 9).devices) == 9
        watch.close()
    assert plugin.metric("gpupool_deviceplugin_kubelet_restarts_total") >= 2


def test_plugin_registers_once_kubelet_appears(kubelet_dir: Path, start_plugin) -> None:
    plugin = start_plugin("l40s-pcie")
    plugin.wait_log(r"waiting for the kubelet")
    assert "not registered" in plugin.wait_healthz(503)
    kubelet = KubeletStandin(kubelet_dir)
    kubelet.start()
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=5.0)
        plugin.wait_healthz(200)
    finally:
        kubelet.stop()


def test_restart_cleans_up_stale_sockets(kubelet: KubeletStandin, kubelet_dir: Path, start_plugin) -> None:
    first = start_plugin("l40s-pcie")
    kubelet.wait_registered({"nvidia.com/gpu"})
    first.kill()  # SIGKILL: its socket stays behind
    stale = kubelet_dir / "gpupool-gpu.sock"
    assert stale.exists()
    # a stale socket of a resource the new plugin does not serve is removed too
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(kubelet_dir / "gpupool-mig-7g.80gb.sock"))
    leftover.close()
    since = time.monotonic()
    second = start_plugin("l40s-pcie", node="node-b")
    second.wait_log(r"removed stale sockets of a previous plugin: .*gpupool-gpu\.sock")
    kubelet.wait_registered({"nvidia.com/gpu"}, since=since)
    assert not (kubelet_dir / "gpupool-mig-7g.80gb.sock").exists()
    assert len(kubelet.plugin("nvidia.com/gpu").watch().latest().devices) == 4
    assert second.stop() == 0
    assert not list(kubelet_dir.glob("gpupool-*.sock")), "a clean stop removes its sockets"


def test_nvml_init_failure_is_retried_with_backoff(kubelet: KubeletStandin, start_plugin, tmp_path: Path) -> None:
    profile = tmp_path / "flaky.yaml"
    shipped = Path(__import__("gpupool_deviceplugin.nvml.profiles", fromlist=["x"]).__file__).parent
    profile.write_text((shipped / "l40s-pcie.yaml").read_text().replace("name: l40s-pcie", "name: flaky")
                       + "nvml: {init_failures: 2, init_error: DRIVER_NOT_LOADED}\n")
    plugin = start_plugin(str(profile))
    plugin.wait_log(r"NVML init failed \(attempt 1\): Driver Not Loaded\. Is the NVIDIA driver loaded")
    assert "waiting for NVML" in plugin.wait_healthz(503)
    plugin.wait_log(r"NVML init failed \(attempt 2\).*Retrying in 2\.0s")
    kubelet.wait_registered({"nvidia.com/gpu"}, timeout=15)
    plugin.wait_healthz(200)
    assert plugin.metric("gpupool_deviceplugin_nvml_init_failures_total") == 2
    assert plugin.proc.poll() is None


@pytest.mark.parametrize(("config", "field"), [
    ("migStrategy: sometimes\n", "migStrategy"),
    ("gpuMemory: {unitMiB: 1}\n", "gpuMemory.unitMiB"),
    ("health: {ignoredXids: [13, x]}\n", "health.ignoredXids.1"),
    ("healthh: {}\n", "healthh"),
    ("metrics: [1, 2]\n", "metrics"),
])
def test_malformed_config_stops_startup_naming_the_field(tmp_path: Path, kubelet_dir: Path, config: str,
                                                         field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    result = subprocess.run([*plugin_command(), "--fake-nvml", "l40s-pcie", "--kubelet-dir", str(kubelet_dir),
                             "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"field {field}:" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_profile_and_missing_kubelet_dir_are_clear_errors(tmp_path: Path, kubelet_dir: Path) -> None:
    result = subprocess.run([*plugin_command(), "--fake-nvml", "dgx-h9000", "--kubelet-dir", str(kubelet_dir)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unknown fake NVML profile 'dgx-h9000'" in result.stderr
    result = subprocess.run([*plugin_command(), "--fake-nvml", "dgx-h100", "--kubelet-dir", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_sigterm_stops_cleanly(kubelet: KubeletStandin, tmp_path: Path, kubelet_dir: Path) -> None:
    plugin = PluginProcess(tmp_path, kubelet_dir, "dgx-h100").start()
    kubelet.wait_registered({"nvidia.com/gpu"})
    assert plugin.stop() == 0
    assert "shutting down" in plugin.log()
