"""The plugin process measures its GPUs' activity with the --idle-* flags, as scripted in the fake NVML's
events file, and serves it on /metrics (real process, real HTTP)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from gpupool_deviceplugin.nvml.fake import fake_gpu_uuid
from tests.support.plugin_process import PluginProcess


def test_gpu_activity_follows_the_script(start_plugin: Callable[..., PluginProcess]) -> None:
    plugin = start_plugin("l40s-pcie", node="node-idle", extra_args=["--idle-sample-interval", "0.2",
                                                                     "--idle-window", "1"])
    gpu = fake_gpu_uuid("node-idle", 2)
    plugin.wait_log(r"idle sampling every 0.2s \(window 1s, activity < 1 %, memory within 1 %, start grace 300s\)")
    with plugin.events.open("a") as fh:
        fh.write(json.dumps({"uuid": gpu, "activity": {"utilization": 42, "memoryUsedMiB": 512, "powerW": 210}})
                 + "\n")
    deadline = time.monotonic() + 10
    while plugin.metric("gpupool_deviceplugin_gpu_activity_percent", uuid=gpu) != 42:
        assert time.monotonic() < deadline, "the scripted activity never showed on /metrics"
        time.sleep(0.1)
    assert plugin.metric("gpupool_deviceplugin_gpu_memory_used_bytes", uuid=gpu) == 512 << 20
    assert plugin.metric("gpupool_deviceplugin_gpu_power_watts", uuid=gpu) == 210
    other = fake_gpu_uuid("node-idle", 1)
    assert plugin.metric("gpupool_deviceplugin_gpu_activity_percent", uuid=other) == 0
    assert plugin.metric("gpupool_deviceplugin_idle_samples_total", result="ok") > 4


def test_sampling_off(start_plugin: Callable[..., PluginProcess]) -> None:
    plugin = start_plugin("l40s-pcie", node="node-off", extra_args=["--idle-sample-interval", "0"])
    plugin.wait_log(r"idle sampling off")
    _, text = plugin.http("/metrics")
    assert "gpupool_deviceplugin_gpu_activity_percent{" not in text


def test_the_real_nvml_check_reads_the_activity_counters_in_its_dry_run() -> None:
    """hack/check_real_nvml.py, ready for a GPU machine: its dry run on the fake reads every counter."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "hack" / "check_real_nvml.py"
    done = subprocess.run([sys.executable, str(script), "--fake-nvml", "l40s-pcie", "--no-plugin"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2b. activity counters" in done.stdout
    assert done.stdout.count("activity is a percentage") == 8  # 4 GPUs, 2 rounds
    assert "round 2 GPU 3: activity 0.0 % (samples)" in done.stdout
