"""The allocator's decisions around the AdmissionBook: when a miss re-lists the node's pods (issue 8,
item 5), when the kubelet's pod list is asked, and where pods without an assignment are steered.
The real Allocator and AdmissionBook; the re-list and the kubelet's pod list are counted callables."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpupool_deviceplugin.admission import AdmissionBook, AdmissionError, KubeletPod
from gpupool_deviceplugin.allocator import Allocator
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_deviceplugin.pods import pod_record
from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_deviceplugin.resources import build_resources
from tests.support.objects import assignment, pod_json

NODE = "node-a"
GPU = "nvidia.com/gpu"
INV = node_publication_for_profile("nvlink-pairs", node_name=NODE).inventory
UUIDS = [g.uuid for g in INV.gpus]
RESOURCES = build_resources(INV, PluginConfig(), memory_units=True)
NAMES = [r.name for r in RESOURCES]


@dataclass
class Relists:
    calls: int = 0
    then_add: list[dict] = field(default_factory=list)  # pods the "API server" shows on the next list
    book: AdmissionBook | None = None

    def __call__(self) -> bool:
        self.calls += 1
        for obj in self.then_add:
            self.book.upsert(pod_record(obj, NAMES, NODE))
        self.then_add = []
        return True


@dataclass
class Kubelet:
    keys: list[str]
    calls: int = 0

    def pods(self, purpose: str) -> list[KubeletPod]:
        self.calls += 1
        return [KubeletPod(*k.split("/"), {}) for k in self.keys]


def allocator(kubelet: Kubelet | None = None) -> tuple[Allocator, AdmissionBook, Relists]:
    book = AdmissionBook(NODE, RESOURCES, 1024)
    book.replace_all([])
    relists = Relists(book=book)
    return Allocator(RESOURCES, INV, PluginConfig(), PluginMetrics(), book, relists, None, kubelet), book, relists


def test_pods_of_other_schedulers_never_relist() -> None:
    alloc, book, relists = allocator()
    book.upsert(pod_record(pod_json("foreign", "uf", NODE, {"a": {GPU: 2}, "b": {GPU: 2}}), NAMES, NODE))
    for _ in range(20):
        assert len(alloc.preferred(GPU, UUIDS, [], 2)) == 2
    ids = alloc.preferred(GPU, UUIDS, [], 2)
    alloc.allocate(GPU, ids)
    for _ in range(20):  # its second container
        alloc.preferred(GPU, [u for u in UUIDS if u not in ids], [], 2)
    assert relists.calls == 0


def test_an_unexplained_miss_relists_and_finds_the_late_pod() -> None:
    """The kubelet saw a bind before the pod watch did: one re-list, and the assignment is followed."""
    alloc, _, relists = allocator()
    ann = assignment(NODE, "u1", {"m": {"devices": {GPU: [UUIDS[5], UUIDS[7]]}}})
    relists.then_add = [pod_json("late", "u1", NODE, {"m": {GPU: 2}}, annotations=ann)]
    assert alloc.preferred(GPU, UUIDS, [], 2) == [UUIDS[5], UUIDS[7]]
    assert relists.calls == 1


def test_with_the_kubelets_pod_list_a_miss_relists_only_for_a_pod_the_watch_has_not_shown() -> None:
    kubelet = Kubelet(["ns/dns"])
    alloc, book, relists = allocator(kubelet)
    book.upsert(pod_record(pod_json("dns", "ud", NODE, {"c": {}}), NAMES, NODE))
    for _ in range(10):  # a static pod without a mirror, say: nothing to find by listing
        alloc.preferred(GPU, UUIDS, [], 3)
    assert relists.calls == 0 and kubelet.calls == 10
    kubelet.keys.append("ns/late")
    ann = assignment(NODE, "u1", {"m": {"devices": {GPU: [UUIDS[1], UUIDS[3], UUIDS[4]]}}})
    relists.then_add = [pod_json("late", "u1", NODE, {"m": {GPU: 3}}, annotations=ann)]
    assert alloc.preferred(GPU, UUIDS, [], 3) == [UUIDS[1], UUIDS[3], UUIDS[4]]
    assert relists.calls == 1


def test_the_kubelets_pod_list_is_asked_only_for_same_shape_pods() -> None:
    kubelet = Kubelet(["ns/second"])
    alloc, book, _ = allocator(kubelet)
    for name, uid, gpu, rv in (("first", "u1", 0, "5"), ("second", "u2", 2, "6")):
        ann = assignment(NODE, uid, {"m": {"devices": {GPU: [UUIDS[gpu]]}}})
        book.upsert(pod_record(pod_json(name, uid, NODE, {"m": {GPU: 1}}, annotations=ann, rv=rv), NAMES, NODE))
    assert alloc.preferred(GPU, UUIDS, [], 1) == [UUIDS[2]]  # first bound, but the kubelet is admitting second
    assert kubelet.calls == 1
    alloc.allocate(GPU, [UUIDS[2]])
    assert alloc.preferred(GPU, UUIDS, [], 1) == [UUIDS[0]]  # only one pending pod left: no need to ask
    assert kubelet.calls == 2  # (the Allocate above asked once more)


def test_pods_without_an_assignment_are_steered_off_assigned_gpus() -> None:
    """On nvlink-pairs topology alone gives a 2-GPU request the bridged pair (0, 2); a pending gpupool pod
    was assigned exactly those (for its second container), so the foreign pod gets the next best pair."""
    alloc, book, _ = allocator()
    assert sorted(alloc.preferred(GPU, UUIDS, [], 2)) == sorted([UUIDS[0], UUIDS[2]])
    plan = assignment(NODE, "u1", {"m": {"devices": {GPU: UUIDS[4:]}}, "x": {"devices": {GPU: [UUIDS[0], UUIDS[2]]}}})
    book.upsert(pod_record(pod_json("planned", "u1", NODE, {"m": {GPU: 4}, "x": {GPU: 2}}, annotations=plan),
                           NAMES, NODE))
    book.upsert(pod_record(pod_json("foreign", "uf", NODE, {"a": {GPU: 2}}), NAMES, NODE))
    chosen = alloc.preferred(GPU, UUIDS[:4], [], 2)
    assert sorted(chosen) == sorted([UUIDS[1], UUIDS[3]])


def test_a_pod_the_kubelet_put_on_other_gpus_than_assigned_is_refused_only_when_known() -> None:
    """Its pod list says the kubelet is admitting pod p, whose assignment is GPUs 0 and 2, and it allocated
    GPUs 1 and 3 (say, a Topology Manager policy): refused. When the kubelet is admitting a pod the plugin
    cannot see (a static pod), the same devices are allowed, unattributed."""
    kubelet = Kubelet(["kube-system/static-x"])
    alloc, book, _ = allocator(kubelet)
    ann = assignment(NODE, "u1", {"m": {"devices": {GPU: [UUIDS[0], UUIDS[2]]}}})
    book.upsert(pod_record(pod_json("p", "u1", NODE, {"m": {GPU: 2}}, annotations=ann), NAMES, NODE))
    alloc.allocate(GPU, [UUIDS[1], UUIDS[3]])
    assert alloc.metrics.registry.get_sample_value("gpupool_deviceplugin_allocations_total", {
        "resource": GPU, "via": "unattributed", "result": "ok"}) == 1
    kubelet.keys.append("ns/p")
    with pytest.raises(AdmissionError, match=r"not what gpupool assigned") as err:
        alloc.allocate(GPU, [UUIDS[5], UUIDS[7]])
    assert err.value.reason == "not_assigned" and err.value.pod.name == "p"


def test_pods_without_an_assignment_are_steered_off_gpus_in_the_other_use() -> None:
    """A GPU with memory-share tenants that the kubelet still offers whole (its ListAndWatch view is
    behind the flip) is not suggested to another scheduler's pod: Allocate would refuse it
    (gpu_is_shared) and the kubelet fail the pod. Likewise a GPU held whole for memory units."""
    alloc, book, _ = allocator()
    mem = "nvidia.com/gpu-memory"
    assert alloc.preferred(GPU, [UUIDS[1], UUIDS[3]], [], 1) == [UUIDS[1]]  # the lower index, by default
    share = assignment(NODE, "us", {"m": {"memory": (UUIDS[1], 4, 1024)}})
    book.upsert(pod_record(pod_json("sharer", "us", NODE, {"m": {mem: 4}}, annotations=share), NAMES, NODE))
    assert alloc.preferred(GPU, [UUIDS[1], UUIDS[3]], [], 1) == [UUIDS[3]]

    whole = assignment(NODE, "uw", {"m": {"devices": {GPU: [UUIDS[5]]}}})
    book.upsert(pod_record(pod_json("trainer", "uw", NODE, {"m": {GPU: 1}}, annotations=whole), NAMES, NODE))
    units = [u for u in alloc._by_id[mem] if alloc._by_id[mem][u].gpu_uuid in (UUIDS[5], UUIDS[6])]
    chosen = alloc.preferred(mem, units, [], 2)
    assert {alloc._by_id[mem][u].gpu_uuid for u in chosen} == {UUIDS[6]}, chosen
