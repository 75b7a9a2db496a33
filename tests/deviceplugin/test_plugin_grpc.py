"""The plugin as a real process against the kubelet stand-in over real gRPC (no API server)."""

from __future__ import annotations

import grpc
import pytest

from gpupool_deviceplugin.publication import node_publication_for_profile
from tests.support.kubelet_standin import ContainerRequest, DeviceManager, KubeletStandin

# resources the plugin serves without an API server: no nvidia.com/gpu-memory (it needs the pod watch)
EXPECTED = {
    "dgx-h100": {"nvidia.com/gpu": 8},
    "l40s-pcie": {"nvidia.com/gpu": 4},
    "nvlink-pairs": {"nvidia.com/gpu": 8},
    "a100-mig": {"nvidia.com/gpu": 5, "nvidia.com/mig-1g.10gb": 9, "nvidia.com/mig-2g.20gb": 1,
                 "nvidia.com/mig-3g.40gb": 3},
}


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_registers_every_resource_and_lists_devices(profile: str, kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin(profile)
    regs = kubelet.wait_registered(set(EXPECTED[profile]))
    inventory = node_publication_for_profile(profile, node_name="node-a").inventory
    numa_of = {g.uuid: g.numa_node for g in inventory.gpus}
    numa_of |= {m.uuid: g.numa_node for g in inventory.gpus for m in g.mig_devices}
    for resource, count in EXPECTED[profile].items():
        reg = regs[resource]
        assert reg.version == "v1beta1" and reg.preferred_allocation
        assert (kubelet.directory / reg.endpoint).exists()
        client = kubelet.plugin(resource)
        assert client.options().get_preferred_allocation_available
        watch = client.watch()
        devices = watch.wait(lambda lst, n=count: len(lst.devices) == n).devices
        watch.close()
        assert all(d.health == "Healthy" for d in devices.values())
        for device_id, device in devices.items():  # TopologyInfo carries the device's NUMA node
            assert [n.ID for n in device.topology.nodes] == [numa_of[device_id]]
    assert plugin.wait_healthz(200) == "ok\n"


def test_preferred_allocation_picks_the_nvlink_pair(kubelet: KubeletStandin, start_plugin) -> None:
    start_plugin("nvlink-pairs")
    kubelet.wait_registered({"nvidia.com/gpu"})
    uuids = [g.uuid for g in node_publication_for_profile("nvlink-pairs", node_name="node-a").inventory.gpus]
    client = kubelet.plugin("nvidia.com/gpu")
    # bridges join (0,2) (1,3) (4,6) (5,7): lowest indices (0,1) would be a PCIe-only pair
    assert client.preferred(uuids, 2) == [uuids[0], uuids[2]]
    assert sorted(client.preferred(uuids, 2, must_include=[uuids[5]])) == sorted([uuids[5], uuids[7]])
    # with GPU 0 busy, one GPU goes to 2 (0's partner) so that the intact pairs stay intact
    assert client.preferred(uuids[1:], 1) == [uuids[2]]
    # four GPUs: two linked pairs on one socket
    assert sorted(client.preferred(uuids, 4)) == sorted(uuids[:4])


def test_allocate_whole_gpus_and_mig_devices(kubelet: KubeletStandin, start_plugin) -> None:
    start_plugin("a100-mig")
    kubelet.wait_registered(set(EXPECTED["a100-mig"]))
    inv = node_publication_for_profile("a100-mig", node_name="node-a").inventory
    dm = DeviceManager(kubelet, ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"])
    try:
        admitted = dm.admit_pod([ContainerRequest("train", {"nvidia.com/gpu": 2}),
                                 ContainerRequest("infer", {"nvidia.com/mig-3g.40gb": 1})])
    finally:
        dm.close()
    gpus = admitted["train"].devices["nvidia.com/gpu"]
    assert set(gpus) <= {g.uuid for g in inv.gpus if not g.mig_enabled}
    assert admitted["train"].responses["nvidia.com/gpu"].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpus)
    mig = admitted["infer"].devices["nvidia.com/mig-3g.40gb"]
    assert mig[0].startswith("MIG-")
    assert admitted["infer"].responses["nvidia.com/mig-3g.40gb"].envs["NVIDIA_VISIBLE_DEVICES"] == mig[0]


def test_allocate_with_cdi_names_devices_by_cdi(kubelet: KubeletStandin, start_plugin) -> None:
    start_plugin("l40s-pcie", config={"cdi": {"enabled": True}})
    kubelet.wait_registered({"nvidia.com/gpu"})
    uuid = node_publication_for_profile("l40s-pcie", node_name="node-a").inventory.gpus[3].uuid
    resp = kubelet.plugin("nvidia.com/gpu").allocate([uuid])
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={uuid}"]
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"nvidia.com/gpu={uuid}"


def test_allocate_unknown_device_is_invalid_argument(kubelet: KubeletStandin, start_plugin) -> None:
    plugin = start_plugin("l40s-pcie")
    kubelet.wait_registered({"nvidia.com/gpu"})
    with pytest.raises(grpc.RpcError) as err:
        kubelet.plugin("nvidia.com/gpu").allocate(["GPU-does-not-exist"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-does-not-exist" in err.value.details()
    assert plugin.metric("gpupool_deviceplugin_handshake_failures_total", reason="unknown_device") == 1


def test_mig_strategy_single_and_none(kubelet: KubeletStandin, start_plugin, tmp_path) -> None:
    # single refuses a node with mixed MIG layouts, with a message saying why, and keeps retrying
    plugin = start_plugin("a100-mig", config={"migStrategy": "single"})
    plugin.wait_log(r"migStrategy=single needs MIG enabled on every GPU")
    assert "discovery failed" in plugin.wait_healthz(503)
    plugin.stop()
    # none: every GPU is a whole nvidia.com/gpu, MIG devices are not advertised
    start_plugin("a100-mig", node="node-b", config={"migStrategy": "none"})
    kubelet.wait_registered({"nvidia.com/gpu"})
    watch = kubelet.plugin("nvidia.com/gpu").watch()
    assert len(watch.wait(lambda lst: len(lst.devices) == 8).devices) == 8
    watch.close()
    assert not any(r.resource.startswith("nvidia.com/mig-") for r in kubelet.registrations
                   if r.at > kubelet.registrations[0].at)
