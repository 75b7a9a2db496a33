"""The kubelet is admitting a pod the plugin's pod watch has not delivered yet, and the watch delivers it
while the plugin asks the kubelet's pod list (PodResources) why no pod explains the call. The plugin must
then match the call again, not fall back to topology / best fit: the fallback keeps off the devices that
pending assignments name, the pod's own included, so the kubelet would take other devices and the plugin
refuse its Allocate (`not_assigned`), or take another pending pod's devices (`swap`). Seen as both refusals
in tests/e2e/test_same_shape_burst.py; see docs/handshake.md, "Re-lists".

The real Allocator and AdmissionBook; the re-list and the kubelet's pod list are in-process callables, the
latter feeding the book the pod watch's event at the moment the plugin asks it (the race)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpupool_deviceplugin.admission import AdmissionBook, KubeletPod
from gpupool_deviceplugin.allocator import Allocator
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import pod_record
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_deviceplugin.resources import build_resources, memory_unit_id, split_memory_unit_id
from tests.support.objects import assignment, pod_json

NODE = "node-a"
GPU, MEM = "nvidia.com/gpu", "nvidia.com/gpu-memory"
INV = node_publication_for_profile("l40s-pcie", node_name=NODE).inventory  # the e2e tests' profile
UUIDS = [g.uuid for g in INV.gpus]
RESOURCES = build_resources(INV, PluginConfig(), memory_units=True)
NAMES = [r.name for r in RESOURCES]
ALL_UNITS = [memory_unit_id(g.uuid, k) for g in INV.gpus for k in range(g.memory_mib // 1024)]


@dataclass
class WatchDuringList:
    """PodResources List of a kubelet admitting `keys`; while it answers, the plugin's pod watch delivers
    `deliver` to the book."""

    book: AdmissionBook
    keys: list[str]
    deliver: list[dict] = field(default_factory=list)
    calls: int = 0

    def pods(self, purpose: str) -> list[KubeletPod]:
        self.calls += 1
        for obj in self.deliver:
            self.book.upsert(pod_record(obj, NAMES, NODE))
        self.deliver = []
        return [KubeletPod(*k.split("/"), {}) for k in self.keys]


@dataclass
class Relists:
    calls: int = 0

    def __call__(self) -> bool:
        self.calls += 1  # the API server has nothing the watch has not delivered
        return True


def plugin(keys: list[str]) -> tuple[Allocator, AdmissionBook, WatchDuringList, Relists]:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    book.replace_all([])
    kubelet, relists = WatchDuringList(book, keys), Relists()
    alloc = Allocator(RESOURCES, INV, PluginConfig(), PluginMetrics(), book, relists, None, kubelet)
    return alloc, book, kubelet, relists


def allocations(alloc: Allocator, resource: str, via: str) -> float:
    return alloc.metrics.registry.get_sample_value("gpupool_deviceplugin_allocations_total", {
        "resource": resource, "via": via, "result": "ok"}) or 0.0


def one_gpu_pod(name: str, uid: str, gpu: str, rv: str) -> dict:
    ann = assignment(NODE, uid, {"main": {"devices": {GPU: [gpu]}}})
    return pod_json(name, uid, NODE, {"main": {GPU: 1}}, annotations=ann, rv=rv)


@pytest.mark.parametrize("kind", ["whole GPU", "memory share"])
def test_a_pod_the_watch_delivers_while_the_kubelets_list_is_asked_gets_its_assignment(kind: str) -> None:
    alloc, book, kubelet, relists = plugin(["ns/p"])
    if kind == "whole GPU":
        resource, available, size, gpu = GPU, UUIDS, 1, UUIDS[2]
        kubelet.deliver = [one_gpu_pod("p", "u1", gpu, "10")]
    else:  # best fit alone would take the lowest-named GPU: the share is on another
        resource, available, size, gpu = MEM, ALL_UNITS, 8, max(UUIDS)
        ann = assignment(NODE, "u1", {"main": {"memory": (gpu, 8, 1024)}})
        kubelet.deliver = [pod_json("p", "u1", NODE, {"main": {MEM: 8}}, annotations=ann, rv="10")]

    chosen = alloc.preferred(resource, available, [], size)

    assert book.pods() and kubelet.calls == 1  # the miss asked the kubelet; the watch delivered meanwhile
    assert relists.calls == 0  # the kubelet had no pod the book lacked by then: no re-list needed
    assert {(split_memory_unit_id(i) or (i,))[0] for i in chosen} == {gpu} and len(chosen) == size
    alloc.allocate(resource, chosen)  # what the kubelet does with the preference: no refusal
    assert allocations(alloc, resource, "assignment") == 1
    assert book.tenancy().whole.get(gpu) == (("ns/p",) if kind == "whole GPU" else None)


def test_same_shape_pods_bound_while_the_first_is_admitted_are_not_swapped() -> None:
    """The CI sequence: b's bind reaches the kubelet before the plugin's watch. b's GetPreferredAllocation
    misses; while the kubelet's list is asked, the watch delivers b; a (same shape) is bound right after.
    Falling back, the plugin kept off b's GPU only and preferred a's GPU (topology's choice); the kubelet
    took it, and b's Allocate was refused: `swap`, b assigned X_b but given a's X_a."""
    gpu_b = UUIDS[3]
    fresh, _, _, _ = plugin([])  # topology's choice when b's GPU is reserved: make that a's GPU
    (gpu_a,) = fresh.preferred(GPU, [u for u in UUIDS if u != gpu_b], [], 1)
    alloc, book, kubelet, _ = plugin(["ns/b"])
    kubelet.deliver = [one_gpu_pod("b", "ub", gpu_b, "10")]

    chosen = alloc.preferred(GPU, UUIDS, [], 1)
    book.upsert(pod_record(one_gpu_pod("a", "ua", gpu_a, "11"), NAMES, NODE))
    alloc.allocate(GPU, chosen)  # b; the kubelet's list tells it apart from a

    assert chosen == [gpu_b]
    kubelet.keys.append("ns/a")  # then the kubelet admits a
    chosen_a = alloc.preferred(GPU, [u for u in UUIDS if u != gpu_b], [], 1)
    alloc.allocate(GPU, chosen_a)
    assert chosen_a == [gpu_a]
    assert book.tenancy().whole == {gpu_a: ("ns/a",), gpu_b: ("ns/b",)}
    assert allocations(alloc, GPU, "assignment") == 2
