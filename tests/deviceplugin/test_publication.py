"""What a node publishes: capacity, GFD labels, the versioned inventory annotation; patch only on change."""

from __future__ import annotations

import json

import pytest

from gpupool_common.inventory import INVENTORY_ANNOTATION, InventoryError, parse_inventory
from gpupool_deviceplugin.config import PluginConfig, parse_config
from gpupool_deviceplugin.kube.node_publisher import node_patch
from gpupool_deviceplugin.publication import node_publication_for_profile


@pytest.mark.parametrize(("profile", "capacity"), [
    ("dgx-h100", {"nvidia.com/gpu": "8", "nvidia.com/gpu-memory": str(8 * (81559 // 1024))}),
    ("l40s-pcie", {"nvidia.com/gpu": "4", "nvidia.com/gpu-memory": str(4 * (46068 // 1024))}),
    ("nvlink-pairs", {"nvidia.com/gpu": "8", "nvidia.com/gpu-memory": "640"}),
    ("a100-mig", {"nvidia.com/gpu": "5", "nvidia.com/gpu-memory": "400", "nvidia.com/mig-1g.10gb": "9",
                  "nvidia.com/mig-2g.20gb": "1", "nvidia.com/mig-3g.40gb": "3"}),
])
def test_capacity_counts_devices_per_resource(profile: str, capacity: dict[str, str]) -> None:
    assert node_publication_for_profile(profile).capacity == capacity


def test_capacity_follows_config() -> None:
    cfg = parse_config({"gpuMemory": {"unitMiB": 1019}, "migStrategy": "none", "resources": {"mig": False}})
    pub = node_publication_for_profile("dgx-h100", cfg)
    assert pub.capacity["nvidia.com/gpu-memory"] == str(8 * 80)  # 80 units of 1019 MiB per 80GB GPU
    mig_none = node_publication_for_profile("a100-mig", parse_config({"migStrategy": "none"}))
    assert mig_none.capacity == {"nvidia.com/gpu": "8", "nvidia.com/gpu-memory": "400"}
    only_gpu = node_publication_for_profile("l40s-pcie", parse_config({"resources": {"gpuMemory": False}}))
    assert only_gpu.capacity == {"nvidia.com/gpu": "4"}
    assert only_gpu.labels["nvidia.com/gpu.sharing-strategy"] == "none"


def test_labels_and_host_capacity() -> None:
    pub = node_publication_for_profile("dgx-h100")
    assert pub.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert pub.labels["nvidia.com/gpu.memory"] == "81559"
    assert pub.labels["nvidia.com/gpu.count"] == "8"
    assert pub.labels["nvidia.com/mig.capable"] == "true"
    assert node_publication_for_profile("l40s-pcie").labels["nvidia.com/mig.capable"] == "false"
    assert pub.host_capacity == {"cpu": "224", "memory": "2Ti", "pods": "110"}


def test_inventory_annotation_round_trips() -> None:
    pub = node_publication_for_profile("a100-mig", node_name="gpu-7")
    raw = pub.annotations[INVENTORY_ANNOTATION]
    inv = parse_inventory(raw)
    assert inv.version == 1 and len(inv.gpus) == 8
    assert inv.sharing.memory_unit_mib == 1024 and inv.sharing.resources["nvidia.com/mig-1g.10gb"] == 9
    assert inv.gpus[0].mig_devices[0].profile == "1g.10gb"
    assert inv.topology().nvlinks[0][7] == 12
    assert raw == node_publication_for_profile("a100-mig", node_name="gpu-7").annotations[INVENTORY_ANNOTATION]
    with pytest.raises(InventoryError, match="version 2 is not supported"):
        parse_inventory(json.dumps({**json.loads(raw), "version": 2}))


def test_node_patch_only_when_something_changed() -> None:
    pub = node_publication_for_profile("l40s-pcie")
    assert node_patch({}, {}, pub) == {"metadata": {"labels": pub.labels, "annotations": pub.annotations}}
    assert node_patch({**pub.labels, "other": "x"}, dict(pub.annotations), pub) is None
    stale = {**pub.labels, "nvidia.com/gpu.count": "3", "gpupool.io/gpu-memory-unit-mib": "512"}
    cfg = parse_config({"resources": {"gpuMemory": False}})
    no_memory = node_publication_for_profile("l40s-pcie", cfg)
    patch = node_patch(stale, dict(pub.annotations), no_memory)
    assert patch["metadata"]["labels"] == {"nvidia.com/gpu.count": "4", "gpupool.io/gpu-memory-unit-mib": None,
                                           "nvidia.com/gpu.sharing-strategy": "none"}


def test_the_idle_pods_annotation_is_published_only_once_measured_and_patched_on_change() -> None:
    from gpupool_common.idlepods import IDLE_PODS_ANNOTATION, idle_pods_annotation, parse_idle_pods
    from gpupool_deviceplugin.publication import build_publication

    pub = node_publication_for_profile("l40s-pcie")
    assert IDLE_PODS_ANNOTATION not in pub.annotations  # nothing measured: a previous instance's is removed
    assert node_patch(pub.labels, {**pub.annotations, IDLE_PODS_ANNOTATION: "{}"}, pub) == {
        "metadata": {"annotations": {IDLE_PODS_ANNOTATION: None}}}
    text = idle_pods_annotation({"u-2": 1_800_000_100.7, "u-1": 1_800_000_000})
    assert text == '{"u-1":"2027-01-15T08:00:00Z","u-2":"2027-01-15T08:01:40Z"}'
    assert {k: v.timestamp() for k, v in parse_idle_pods(text).items()} == {"u-1": 1_800_000_000,
                                                                            "u-2": 1_800_000_100}
    assert pub.inventory is not None
    idle = build_publication(pub.inventory, [], PluginConfig(), idle_pods=text)
    patch = node_patch(idle.labels, {**idle.annotations, IDLE_PODS_ANNOTATION: "{}"}, idle)
    assert patch == {"metadata": {"annotations": {IDLE_PODS_ANNOTATION: text}}}
    assert node_patch(idle.labels, dict(idle.annotations), idle) is None
    # a restarted plugin whose sampler has not measured yet leaves the last instance's annotation alone
    # (no removal and re-add: a restart patches nothing when nothing changed); without a sampler it goes
    pending = build_publication(pub.inventory, [], PluginConfig(), idle_pending=True)
    assert node_patch(pending.labels, {**pending.annotations, IDLE_PODS_ANNOTATION: text}, pending) is None
    measured = build_publication(pub.inventory, [], PluginConfig(), idle_pods="{}", idle_pending=True)
    assert node_patch(measured.labels, {**measured.annotations, IDLE_PODS_ANNOTATION: text}, measured) == {
        "metadata": {"annotations": {IDLE_PODS_ANNOTATION: "{}"}}}
    with pytest.raises(ValueError):
        parse_idle_pods('["u-1"]')
