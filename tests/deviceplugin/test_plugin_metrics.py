"""The plugin's registration gauge and node info as scraped from /metrics (what the alerts read)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.support.kubelet_standin import KubeletStandin
from tests.support.plugin_process import PluginProcess

REGISTERED = "gpupool_deviceplugin_registered"


def wait_metric(plugin: PluginProcess, name: str, value: float, timeout: float = 5.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (seen := plugin.metric(name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} stayed {seen}, expected {value}"
        time.sleep(0.05)


def test_registered_gauge_follows_the_kubelet(kubelet_dir: Path, start_plugin: Callable[..., PluginProcess]) -> None:
    plugin = start_plugin("l40s-pcie", node="node-m")
    plugin.wait_log(r"waiting for the kubelet")
    assert plugin.metric("gpupool_deviceplugin_node_info", node="node-m") == 1
    _, text = plugin.http("/metrics")
    assert f'{REGISTERED}{{resource="nvidia.com/gpu"}} 0.0' in text, "0 is exported before any kubelet"

    kubelet = KubeletStandin(kubelet_dir)
    kubelet.start()
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=5.0)
        wait_metric(plugin, REGISTERED, 1, resource="nvidia.com/gpu")

        kubelet.stop()  # kubelet.sock is gone: nothing is registered with a live kubelet
        wait_metric(plugin, REGISTERED, 0, resource="nvidia.com/gpu")

        since = time.monotonic()
        kubelet.start()  # a new kubelet.sock: the plugin re-registers
        kubelet.wait_registered({"nvidia.com/gpu"}, since=since, timeout=5.0)
        wait_metric(plugin, REGISTERED, 1, resource="nvidia.com/gpu")
    finally:
        kubelet.stop()
