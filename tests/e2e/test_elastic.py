"""Elastic inference on the local control plane with kube-controller-manager (issue 20 §3).

Two l40s nodes (8 GPUs); a bare pod holds 2 of them. The Deployment `llm` (1 GPU a replica, annotated
`gpupool.io/elastic-min: 2`, `gpupool.io/elastic-max: 6`, demand `always`) starts at 2 replicas and the
scheduler lends it one replica at a time until it runs 6 (the idle cluster's 6 free GPUs). A training gang
of 4 one-GPU members (PodGroup minMember 4) then needs 4 GPUs: the scheduler gives 4 borrowed replicas back
(their deletion cost, the count down to 2: the ReplicaSet controller removes them; kwok's
`gpupool.io/stop-takes: 5s` within their 10 s grace) and the gang is bound on the freed GPUs. Measured: the
handover (the gang created -> every member bound) within the replicas' grace + 30 s; the Deployment never
below 2 Ready replicas nor a count below 2 (sampled every 0.25 s while it shrinks); with the gang deleted
(4 GPUs free again) no replica is lent within the shortened no-flap window (`--elastic-no-flap 40`), and one
is lent after it. The window at its default (300 s): tests/scheduler/test_elastic.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.crds import install_crds
from tests.support.defrag_cluster import bound, deployment
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    list_pods,
    pod,
    pod_condition,
    start_scheduler,
    unique,
    wait_until,
)

GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GRACE_S = 10
NO_FLAP_S = 40.0
MIN, MAX = 2, 6


@pytest.fixture(scope="module")
def pool(kube: ClusterClient) -> Iterator[tuple[str, list[str]]]:
    install_crds(kube.api_client)  # the PodGroup CRD among the project's
    name = unique("elastic")
    nodes = add_pool_nodes(kube, name, "l40s-pcie", 2)
    yield name, nodes
    kube.delete_nodes(nodes)


@pytest.fixture(scope="module")
def scheduler(kube: ClusterClient, tmp_path_factory: pytest.TempPathFactory,
              pool: object) -> Iterator[SchedulerProcess]:
    proc = start_scheduler(kube, unique("gpupool"), tmp_path_factory.mktemp("elastic-logs"),
                           "--elastic-no-flap", str(NO_FLAP_S))
    yield proc
    proc.stop()
    assert proc.process.returncode == 0, f"scheduler exited with {proc.process.returncode}:\n{proc.tail()}"


def replicas_of(kube: ClusterClient, namespace: str, app: str = "llm") -> list[dict[str, Any]]:
    return [p for p in list_pods(kube, namespace)
            if (p["metadata"].get("labels") or {}).get("app") == app and not p["metadata"].get("deletionTimestamp")]


def ready(p: dict[str, Any]) -> bool:
    condition = pod_condition(p, "Ready")
    return bound(p) and condition is not None and condition.get("status") == "True"


def spec_replicas(apps: client.AppsV1Api, namespace: str) -> int:
    return int(apps.read_namespaced_deployment("llm", namespace).spec.replicas)


class Sampler:
    """Every 0.25 s on a thread: the fewest Ready replicas and the lowest count seen."""

    def __init__(self, kube: ClusterClient, apps: client.AppsV1Api, namespace: str) -> None:
        self.kube, self.apps, self.namespace = kube, apps, namespace
        self.fewest_ready = 10**6
        self.lowest_count = 10**6
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.fewest_ready = min(self.fewest_ready, sum(1 for p in replicas_of(self.kube, self.namespace)
                                                           if ready(p)))
            self.lowest_count = min(self.lowest_count, spec_replicas(self.apps, self.namespace))
            self.samples += 1
            self._stop.wait(0.25)


def test_an_elastic_deployment_grows_on_idle_gpus_and_gives_four_back_to_a_training_gang(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, pool: tuple[str, list[str]],
    controller_manager: None,
) -> None:
    name, _ = pool
    apps = client.AppsV1Api(kube.api_client)
    began = time.monotonic()
    kube.core.create_namespaced_pod(namespace, pod("other", scheduler.name, name, gpus=2))
    wait_until(lambda: any(p["metadata"]["name"] == "other" and bound(p) for p in list_pods(kube, namespace)),
               30, "the other pod bound")
    template = pod("unused", scheduler.name, name, gpus=1, annotations={"gpupool.io/stop-takes": "5s"})
    template["spec"]["terminationGracePeriodSeconds"] = GRACE_S
    deployment(kube, namespace, "llm", MIN, template,
               {"gpupool.io/elastic-min": str(MIN), "gpupool.io/elastic-max": str(MAX)})

    # grows to max on the idle GPUs, one replica at a time
    wait_until(lambda: sum(1 for p in replicas_of(kube, namespace) if ready(p)) == MAX, 120,
               f"{MAX} Ready replicas")
    grown = time.monotonic() - began
    assert spec_replicas(apps, namespace) == MAX
    ups = [e for e in kube.core.list_namespaced_event(namespace, field_selector="reason=ElasticScaledUp").items]
    assert sum(e.count or 1 for e in ups) == MAX - MIN
    wait_until(lambda: scheduler.metric("gpupool_scheduler_elastic_replicas", deployment="llm", tier="borrowed")
               == MAX - MIN, 10, "the borrowed gauge")
    assert scheduler.metric("gpupool_scheduler_elastic_replicas", deployment="llm", tier="guaranteed") == MIN

    # a training gang needs 4 GPUs: 4 borrowed replicas go back, the gang runs on their GPUs
    client.CustomObjectsApi(kube.api_client).create_namespaced_custom_object(
        "scheduling.x-k8s.io", "v1alpha1", namespace, "podgroups",
        {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": "train"},
         "spec": {"minMember": 4}})
    members = [f"train-{i}" for i in range(4)]
    bound_at: dict[str, float] = {}
    with Sampler(kube, apps, namespace) as sampler:
        asked = time.monotonic()
        for member in members:
            kube.core.create_namespaced_pod(namespace, pod(member, scheduler.name, name, gpus=1,
                                                          labels={GROUP_LABEL: "train"}))

        def all_bound() -> bool:
            now = time.monotonic()
            for p in list_pods(kube, namespace):
                if p["metadata"]["name"] in members and bound(p):
                    bound_at.setdefault(p["metadata"]["name"], now)
            return len(bound_at) == len(members)

        wait_until(all_bound, GRACE_S + 60, "the gang bound", interval=0.25)
        wait_until(lambda: len(replicas_of(kube, namespace)) == MIN, 30, f"{MIN} replicas left")
        time.sleep(1)
    handovers = sorted(t - asked for t in bound_at.values())
    print(f"grown to {MAX} in {grown:.1f}s; handovers (gang created -> member bound): "
          f"{', '.join(f'{h:.1f}' for h in handovers)} s; fewest Ready {sampler.fewest_ready}, lowest count "
          f"{sampler.lowest_count} over {sampler.samples} samples")
    assert max(handovers) <= GRACE_S + 30, handovers  # every handover (so the p99) within grace + 30 s
    assert sampler.fewest_ready >= MIN and sampler.lowest_count >= MIN
    assert spec_replicas(apps, namespace) == MIN
    gave = kube.core.list_namespaced_event(namespace, field_selector="reason=ElasticGaveBack").items
    assert gave and all("for " + namespace + "/train-" in e.message for e in gave), [e.message for e in gave]
    assert sum(int(m) for m in [e.message.split("Gave back ")[1].split(" ")[0] for e in gave]) == MAX - MIN
    assert scheduler.metric("gpupool_scheduler_elastic_scaled_total", direction="down") == MAX - MIN
    assert scheduler.metric("gpupool_scheduler_elastic_handover_seconds_count") >= 1
    print("handover histogram: sum", scheduler.metric("gpupool_scheduler_elastic_handover_seconds_sum"),
          "count", scheduler.metric("gpupool_scheduler_elastic_handover_seconds_count"))

    # no flapping: the gang gone (4 GPUs free), nothing is lent within the window, then it is
    kube.core.delete_collection_namespaced_pod(namespace, label_selector=f"{GROUP_LABEL}=train",
                                               grace_period_seconds=0)
    window_ends = asked + NO_FLAP_S  # the give-back came after `asked`
    while time.monotonic() < window_ends - 1:
        assert spec_replicas(apps, namespace) == MIN, "a replica was lent again within the no-flap window"
        time.sleep(0.5)
    wait_until(lambda: spec_replicas(apps, namespace) > MIN, 30, "a replica lent again after the window")
    print(f"lent again {time.monotonic() - asked:.1f}s after the gang asked (window {NO_FLAP_S:.0f}s)")


def test_with_an_hpa_gpupool_moves_only_its_max_replicas_and_the_two_do_not_fight(
    kube: ClusterClient, namespace: str, scheduler: SchedulerProcess, controller_manager: None,
) -> None:
    """The HPA contract on the real control plane: an HPA (cpu target; no metrics server here, so its
    controller never scales by metrics, only clamps to its bounds) scales `llm`. gpupool lends by raising
    the HPA's maxReplicas one at a time, never the count; the test scales the count within the lent bound as
    the HPA would. A pod needing 2 GPUs makes gpupool lower maxReplicas and the count to 2 together; for 20 s
    (more than the HPA controller's 15 s sync) neither moves again."""
    name = unique("elastic-hpa")
    nodes = add_pool_nodes(kube, name, "l40s-pcie", 2)
    apps = client.AppsV1Api(kube.api_client)
    autoscaling = client.AutoscalingV2Api(kube.api_client)
    try:
        kube.core.create_namespaced_pod(namespace, pod("other", scheduler.name, name, gpus=4))
        template = pod("unused", scheduler.name, name, gpus=1)
        template["spec"]["terminationGracePeriodSeconds"] = 1
        deployment(kube, namespace, "llm", 2, template, {"gpupool.io/elastic-min": "2", "gpupool.io/elastic-max": "4"})
        autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, {
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "llm"},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"},
                     "minReplicas": 2, "maxReplicas": 2,
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]}})

        def hpa_max() -> int:
            return int(autoscaling.read_namespaced_horizontal_pod_autoscaler("llm", namespace).spec.max_replicas)

        for lent in (3, 4):
            wait_until(lambda lent=lent: hpa_max() == lent, 60, f"the HPA's maxReplicas lent to {lent}")
            assert spec_replicas(apps, namespace) == lent - 1, "gpupool never raises the count an HPA owns"
            apps.patch_namespaced_deployment_scale("llm", namespace, {"spec": {"replicas": lent}})  # as the HPA
            wait_until(lambda lent=lent: sum(1 for p in replicas_of(kube, namespace) if ready(p)) == lent, 60,
                       f"{lent} Ready replicas")
        kube.core.create_namespaced_pod(namespace, pod("train", scheduler.name, name, gpus=2))
        wait_until(lambda: any(p["metadata"]["name"] == "train" and bound(p) for p in list_pods(kube, namespace)),
                   60, "the training pod bound")
        assert hpa_max() == 2 and spec_replicas(apps, namespace) == 2
        until = time.monotonic() + 20
        while time.monotonic() < until:
            assert (hpa_max(), spec_replicas(apps, namespace)) == (2, 2), "the HPA and gpupool fight"
            time.sleep(1)
    finally:
        with contextlib.suppress(ApiException):
            autoscaling.delete_namespaced_horizontal_pod_autoscaler("llm", namespace)
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("llm", namespace)
        kube.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        kube.delete_nodes(nodes)
