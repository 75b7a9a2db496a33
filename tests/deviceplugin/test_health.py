"""NVML events -> Unhealthy -> recovery, through the fake NVML backend of a running plugin."""

from __future__ import annotations

import time

from gpupool_deviceplugin.publication import node_publication_for_profile
from tests.support.kubelet_standin import KubeletStandin

FAST_RECOVERY = {"health": {"recoveryQuietPeriodSeconds": 1.0, "eventWaitMs": 50}}


def test_xid_marks_gpu_unhealthy_then_it_recovers(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("dgx-h100", config=FAST_RECOVERY)
    kubelet.wait_registered({"nvidia.com/gpu"})
    gpus = [g.uuid for g in node_publication_for_profile("dgx-h100", node_name="node-a").inventory.gpus]
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    watch.wait(lambda lst: len(lst.healthy()) == 8)

    plugin.inject(uuid=gpus[3], xid=79)  # GPU has fallen off the bus
    bad = watch.wait(lambda lst: lst.unhealthy() == {gpus[3]})
    assert len(bad.healthy()) == 7
    assert plugin.metric("gpupool_deviceplugin_gpu_hardware_healthy", uuid=gpus[3]) == 0
    marked_at = bad.at
    healed = watch.wait(lambda lst: not lst.unhealthy(), timeout=10)
    assert healed.at - marked_at >= 0.9, "recovered before the quiet period"
    assert plugin.metric("gpupool_deviceplugin_health_recoveries_total") == 1
    assert plugin.metric("gpupool_deviceplugin_gpu_hardware_healthy", uuid=gpus[3]) == 1
    watch.close()


def test_application_xids_are_ignored(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("l40s-pcie", config=FAST_RECOVERY)
    kubelet.wait_registered({"nvidia.com/gpu"})
    gpus = [g.uuid for g in node_publication_for_profile("l40s-pcie", node_name="node-a").inventory.gpus]
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    for xid in (13, 31, 43, 45, 68, 109):
        plugin.inject(uuid=gpus[0], xid=xid)
    plugin.inject(uuid=gpus[1], event="double_bit_ecc")  # a marker that is NOT ignored, injected last
    watch.wait(lambda lst: lst.unhealthy() == {gpus[1]})
    assert plugin.metric("gpupool_deviceplugin_health_events_total", kind="xid", action="ignored") == 6
    assert gpus[0] in watch.latest().healthy()
    watch.close()


def test_lost_gpu_stays_unhealthy_until_nvml_answers_again(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("l40s-pcie", config=FAST_RECOVERY)
    kubelet.wait_registered({"nvidia.com/gpu"})
    gpus = [g.uuid for g in node_publication_for_profile("l40s-pcie", node_name="node-a").inventory.gpus]
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    plugin.inject(uuid=gpus[2], lost=True)
    plugin.inject(uuid=gpus[2], xid=79)
    watch.wait(lambda lst: lst.unhealthy() == {gpus[2]})
    plugin.wait_log(r"still failing NVML checks: GPU is lost")
    assert gpus[2] in watch.latest().unhealthy(), "must not recover while NVML says the GPU is lost"
    plugin.inject(uuid=gpus[2], lost=False)
    watch.wait(lambda lst: not lst.unhealthy(), timeout=15)
    watch.close()


def test_xid_on_a_mig_device_marks_only_that_device(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("a100-mig", config={"health": {"recoveryQuietPeriodSeconds": 0, "eventWaitMs": 50}})
    kubelet.wait_registered({"nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"})
    inv = node_publication_for_profile("a100-mig", node_name="node-a").inventory
    gpu1_small = [m.uuid for m in inv.gpus[1].mig_devices if m.profile == "1g.10gb"]
    watch_small = kubelet.plugin("nvidia.com/mig-1g.10gb").watch()
    watch_big = kubelet.plugin("nvidia.com/mig-3g.40gb").watch()
    plugin.inject(uuid=gpu1_small[0], xid=94)  # contained ECC error in one GPU instance
    watch_small.wait(lambda lst: lst.unhealthy() == {gpu1_small[0]})
    assert not watch_big.latest().unhealthy()
    # an event for the whole GPU takes every MIG device on it down
    plugin.inject(uuid=inv.gpus[2].uuid, event="double_bit_ecc")
    gpu2 = {m.uuid for m in inv.gpus[2].mig_devices}
    watch_big.wait(lambda lst: lst.unhealthy() == gpu2)
    time.sleep(1.5)  # recovery disabled (quiet period 0): still unhealthy later
    assert watch_big.latest().unhealthy() == gpu2
    watch_small.close()
    watch_big.close()
