"""Bursts of same-shape pods on nodes whose plugin knows pod identity (PodResources): the scheduler holds
no per-(node, shape) gate there, so several 1-GPU pods and several memory-share pods of one size are bound
to a node while the kubelet is still admitting the first of them. Every one must be admitted with exactly
its assignment: no Allocate refused (the kubelet would fail the pod), no GPU swapped, none oversubscribed.

The plugins, kubelet stand-ins and the scheduler are those of test_scheduler_fullpath.py (tests.support.plugin_pool).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_common.inventory import INVENTORY_ANNOTATION, parse_inventory
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.raw import discard, read_json
from tests.support.node_kubelet import assert_kubelet_got_the_assignment
from tests.support.plugin_pool import Pool, plugin_pool
from tests.support.plugin_process import plugin_counter
from tests.support.scheduler_harness import (
    assert_no_oversubscription,
    list_pods,
    pod,
    start_scheduler,
    stop_scheduler,
    unique,
    wait_until,
)

ROUNDS = 10
WHOLE = 6  # 1-GPU pods per round, of the pool's 8 GPUs
SHARES = 4  # 8-unit memory pods per round


@pytest.fixture(scope="module")
def burst_pool(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with plugin_pool(kube, tmp_path_factory.mktemp("burst"), "burst", pod_resources=True) as made:
        for node in made.nodes:
            def identity(node: str = node) -> bool:
                obj = read_json(kube.core.read_node(node, _preload_content=False))
                return parse_inventory(obj["metadata"]["annotations"][INVENTORY_ANNOTATION]).pod_identity
            wait_until(identity, 30, f"{node}: the plugin publishes pod_identity", interval=0.1)
        yield made


def _plugin_errors(pool: Pool) -> str:
    return "\n".join(f"{n.name}: {line}" for n in pool.nodes.values()
                     for line in n.plugin.log().splitlines() if " ERROR " in line or " WARNING " in line)


def test_bursts_of_same_shape_pods_are_each_admitted_with_their_assignment(
    kube: ClusterClient, namespace: str, burst_pool: Pool, tmp_path: Path
) -> None:
    pool = burst_pool
    proc = start_scheduler(kube, unique("burst"), tmp_path)
    try:
        for round_ in range(ROUNDS):
            for kubelet in pool.kubelets():
                wait_until(kubelet.idle, 30, f"{kubelet.node}: the previous round gone", interval=0.05)
            # interleaved, created back to back: binds of both shapes reach each node together
            manifests = []
            for i in range(max(WHOLE, SHARES)):
                if i < WHOLE:
                    manifests.append(pod(f"train-{round_}-{i}", proc.name, pool.name, gpus=1))
                if i < SHARES:
                    manifests.append(pod(f"infer-{round_}-{i}", proc.name, pool.name, units=8))
            for m in manifests:
                discard(kube.core.create_namespaced_pod(namespace, m, _preload_content=False))
            keys = {f"{namespace}/{m['metadata']['name']}" for m in manifests}
            try:
                pool.wait_acked(keys)
            except AssertionError as exc:
                raise AssertionError(f"round {round_}: {exc}\nplugin warnings and errors:\n"
                                     f"{_plugin_errors(pool)}") from None

            pods = [p for p in list_pods(kube, namespace) if f"{namespace}/{p['metadata']['name']}" in keys]
            assert len(pods) == len(keys)
            for p in pods:
                assert_kubelet_got_the_assignment(p, pool.life(f"{namespace}/{p['metadata']['name']}"))
            assert_no_oversubscription(kube, pods)
            for n in pool.nodes.values():
                assert plugin_counter(n.plugin, "gpupool_deviceplugin_handshake_failures_total") == 0, \
                    f"round {round_}, {n.name}:\n{_plugin_errors(pool)}"
                assert plugin_counter(n.plugin, "gpupool_deviceplugin_handshake_ambiguous_total") == 0, n.name

            for m in manifests:
                discard(kube.core.delete_namespaced_pod(m["metadata"]["name"], namespace, grace_period_seconds=0,
                                                        _preload_content=False))
        assert proc.metric("gpupool_scheduler_gate_waits_total") == 0  # no gate on pod-identity nodes
    finally:
        stop_scheduler(proc)
