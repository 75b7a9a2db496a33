"""`gpupool scheduler` under faults of the control plane and the network (issue 16, section B), on a private
dev cluster of this module (`faults-<pid>`: its kube-apiserver is restarted and its etcd compacted, which the
session's shared cluster must not see).

Between a scheduler and kube-apiserver sits `faultproxy.FaultProxy` (one per replica): it cuts, black-holes
or drops Binding answers, and logs every request it forwards with a wall-clock time. Every scenario ends with
the audit (`audit`): no GPU UUID in two live assignments (and no oversubscription), every plugin ack equal to
its assignment, nothing stuck assumed in the scheduler's ledger, and no pod and no Binding on a deleted node.
The figures of each scenario are printed (`pytest -s`) and written to <tmp>/faults-<scenario>.json.

GPUPOOL_FAULTS_SCHEDULER_SRC=<a src/ folder> runs the schedulers from that source tree instead (e.g.
`git archive <commit> src | tar -x -C /tmp/old` and /tmp/old/src), to see a scenario fail before a fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpupool_common.handshake import parse_ack, parse_assignment
from gpupool_devcluster.client import ClusterClient
from gpupool_devcluster.fake_pods import create_pods
from gpupool_devcluster.raw import discard
from tests.support.faultproxy import BINDING, BLACKHOLE, CUT, PASS, FaultProxy, ProxyRecord, proxy_for
from tests.support.fixtures import fresh_namespace, private_cluster
from tests.support.node_kubelet import NodeKubelet
from tests.support.plugin_pool import plugin_pool
from tests.support.scheduler_harness import (
    SchedulerProcess,
    add_pool_nodes,
    assert_no_oversubscription,
    device_use,
    events_for,
    list_pods,
    pod,
    start_scheduler,
    unique,
    wait_until,
)

LEASE = ["--leader-elect", "--lease-namespace", "default", "--lease-duration", "6", "--renew-deadline", "4",
         "--retry-period", "1"]
LEASE_DURATION_S = 6.0


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def faults() -> Iterator[ClusterClient]:
    """A private dev cluster for this module: its apiserver may be stopped and its etcd compacted."""
    with private_cluster(f"faults-{os.getpid()}", "private control plane for the fault scenarios",
                         audit=False) as handle:
        yield handle


@pytest.fixture
def ns(faults: ClusterClient) -> Iterator[str]:
    with fresh_namespace(faults, "faults") as name:
        yield name


@pytest.fixture
def cleanup(faults: ClusterClient) -> Iterator[list[Any]]:
    """Things to stop at the end of a test (schedulers, proxies), then the test's nodes are deleted."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.stop()
    if faults.created_nodes:
        faults.delete_nodes(list(faults.created_nodes))


@contextlib.contextmanager
def other_source() -> Iterator[None]:
    """Processes started inside run from $GPUPOOL_FAULTS_SCHEDULER_SRC when it is set (they copy os.environ)."""
    source = os.environ.get("GPUPOOL_FAULTS_SCHEDULER_SRC")
    saved = os.environ.get("PYTHONPATH")
    if source:
        os.environ["PYTHONPATH"] = source
    try:
        yield
    finally:
        if source:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved


def proxied_scheduler(kube: ClusterClient, name: str, log_dir: Path, label: str, cleanup: list[Any],
                      *extra: str, ready: bool = True) -> tuple[SchedulerProcess, FaultProxy]:
    """A proxy labelled `label` in front of the apiserver, and a scheduler whose kubeconfig points at it."""
    proxy = proxy_for(kube.cluster.layout.pki.folder, kube.server, label=label,
                      log_file=log_dir / f"proxy-{label}.jsonl").start()
    cleanup.append(proxy)
    kubeconfig = proxy.write_kubeconfig(kube.kubeconfig, log_dir / f"kubeconfig-{label}")
    with other_source():
        scheduler = start_scheduler(replace(kube, kubeconfig=kubeconfig), name, log_dir, *extra, ready=False)
    cleanup.append(scheduler)
    if ready:
        scheduler.wait_ready()
    return scheduler, proxy


class RecoveringKubelet(NodeKubelet):
    """The NodeKubelet of tests.support.node_kubelet, whose pod watch outlives an apiserver outage as a
    kubelet's does: after an error it lists again a second later (the errors are kept in `outages`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outages: list[str] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            super()._run()  # returns when stopped, or after an error it records in `failure`
            with self._cond:
                if self.failure is None:
                    return
                self.outages.append(self.failure)
                self.failure = None
            self._stop.wait(1.0)


# ---------------------------------------------------------------- the audit


def settle(predicate: Any, timeout_s: float, what: str = "", interval: float = 0.5) -> bool:
    """Poll `predicate` up to `timeout_s`; whether it came true (the caller asserts with its own message)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def pinned(manifest: dict[str, Any], node: str) -> dict[str, Any]:
    manifest["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
    return manifest


def live(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]


def double_allocations(kube: ClusterClient, pods: list[dict[str, Any]]) -> dict[str, list[str]]:
    """GPU or MIG device -> the live pods holding it whole, for each one held by more than one."""
    gpus, migs = device_use(kube, live(pods))
    out = {f"{node}/{uuid}": use.whole for (node, uuid), use in gpus.items() if len(use.whole) > 1}
    out.update({f"{node}/{uuid}": holders for (node, uuid), holders in migs.items() if len(holders) > 1})
    return out


def ack_mismatches(pods: list[dict[str, Any]]) -> list[str]:
    """Pods whose plugin ack names other devices than their assignment (kwok nodes write no acks)."""
    out = []
    for p in live(pods):
        annotations = p["metadata"].get("annotations") or {}
        assignment, ack = parse_assignment(annotations), parse_ack(annotations)
        if assignment is None or ack is None or not ack.complete:
            continue
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        if ack.pod_uid != assignment.pod_uid or ack.node != assignment.node:
            out.append(f"{key}: ack for {ack.node}/{ack.pod_uid}, "
                       f"assignment for {assignment.node}/{assignment.pod_uid}")
            continue
        for container in assignment.containers:
            acked = ack.containers.get(container.name, {})
            for resource, ids in container.devices.items():
                if sorted(acked.get(resource, ())) != sorted(ids):
                    out.append(f"{key}/{container.name}: {resource} acked {acked.get(resource)}, assigned {ids}")
    return out


def ledger(scheduler: SchedulerProcess) -> dict[str, float]:
    return {phase: scheduler.metric("gpupool_scheduler_ledger_pods", phase=phase)
            for phase in ("assumed", "bound", "confirmed")}


def audit(kube: ClusterClient, namespace: str, schedulers: Iterable[SchedulerProcess], *,
          deleted_nodes: Iterable[str] = (), bindings: Iterable[ProxyRecord] = (),
          figures: dict[str, Any]) -> None:
    """The double-allocation audit of issue 16, with its figures added to `figures`."""
    deleted = set(deleted_nodes)
    pods = list_pods(kube, namespace)
    on_deleted = sorted(f"{p['metadata']['name']}@{p['spec']['nodeName']}" for p in pods
                        if p["spec"].get("nodeName") in deleted)
    to_deleted = sorted(f"{r.pod}@{r.target}" for r in bindings if r.target in deleted)
    doubles = double_allocations(kube, pods)
    acks = ack_mismatches(pods)
    stuck = {}
    for scheduler in schedulers:
        if scheduler.process.poll() is not None:
            continue
        settle(lambda s=scheduler: ledger(s)["assumed"] + ledger(s)["bound"] == 0, 10, "", interval=0.5)
        phases = ledger(scheduler)
        if phases["assumed"] or phases["bound"]:
            stuck[scheduler.args[-1] if "--identity" in scheduler.args else scheduler.name] = phases
    figures.update({"double_allocations": len(doubles), "pods_on_deleted_nodes": len(on_deleted),
                    "bindings_to_deleted_nodes": len(to_deleted), "ack_mismatches": len(acks),
                    "stuck_in_ledger": stuck})
    assert not on_deleted, f"{len(on_deleted)} pods bound to deleted nodes: {on_deleted[:10]}"
    assert not to_deleted, f"{len(to_deleted)} Bindings sent to deleted nodes: {to_deleted[:10]}"
    assert not doubles, f"{len(doubles)} GPUs in two live assignments: {dict(list(doubles.items())[:5])}"
    assert not acks, f"acks that differ from their assignment: {acks[:5]}"
    assert_no_oversubscription(kube, live(pods))
    assert not stuck, f"pods stuck in the scheduler's ledger before the watch confirmed them: {stuck}"


def report(tmp_path: Path, scenario: str, figures: dict[str, Any]) -> None:
    figures = {"scenario": scenario, **figures}
    text = json.dumps(figures, indent=2, sort_keys=True, default=str)
    (tmp_path / f"faults-{scenario}.json").write_text(text + "\n")
    print(f"\n[faults] {scenario}: {json.dumps(figures, sort_keys=True, default=str)}")


def bound_pods(kube: ClusterClient, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"]["nodeName"] for p in list_pods(kube, namespace)
            if p["spec"].get("nodeName")}


def delete_pods(kube: ClusterClient, namespace: str, names: Iterable[str]) -> None:
    for name in names:
        discard(kube.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _preload_content=False))


def unbound_unreported(kube: ClusterClient, namespace: str) -> list[str]:
    """Pods neither bound nor told why (a FailedScheduling Event)."""
    return [p["metadata"]["name"] for p in list_pods(kube, namespace) if not p["spec"].get("nodeName")
            and not events_for(kube, namespace, p["metadata"]["name"], "FailedScheduling")]


# ---------------------------------------------------------------- scenarios


def test_watch_gap_with_410_forgets_what_was_deleted(
    faults: ClusterClient, ns: str, cleanup: list[Any], tmp_path: Path
) -> None:
    """Cut the scheduler off; delete 2 nodes with their pods and 8 bound pods elsewhere, create 10 pods;
    compact etcd and restart kube-apiserver, so the resumed watch gets 410 Gone and must list again. Let the
    scheduler through: within 10 s the 8 freed GPUs are used, nothing goes to a deleted node, and the metrics
    stop naming the deleted nodes."""
    kube = faults
    began = time.monotonic()
    pool = unique("gap")
    nodes = sorted(add_pool_nodes(kube, pool, "dgx-h100", 6))
    survivors, doomed = nodes[:4], nodes[4:]
    name = unique("gap")
    scheduler, proxy = proxied_scheduler(kube, name, tmp_path, "scheduler", cleanup)
    before = [pinned(pod(f"s{i}-{j}", name, pool, gpus=1), node) for i, node in enumerate(survivors) for j in range(8)]
    before += [pinned(pod(f"d{i}-{j}", name, pool, gpus=1), node) for i, node in enumerate(doomed) for j in range(4)]
    create_pods(kube.core, ns, before, concurrency=8)
    wait_until(lambda: len(bound_pods(kube, ns)) == len(before), 60, "the first 40 pods bound")
    wait_until(lambda: ledger(scheduler)["confirmed"] >= len(before), 15, "the scheduler to confirm 40 pods")
    wait_until(lambda: all(f'node="{d}"' in scheduler.metrics() for d in doomed), 15,
               "the per-node gauges to name the doomed nodes")

    proxy.set_mode(CUT)
    cut_at = time.monotonic()
    cut_wall = time.time()
    delete_pods(kube, ns, [m["metadata"]["name"] for m in before if m["metadata"]["name"].startswith("d")])
    kube.delete_nodes(doomed)
    freed = [f"s{i}-{j}" for i in range(4) for j in range(2)]
    delete_pods(kube, ns, freed)
    wait_until(lambda: not set(freed) & set(bound_pods(kube, ns)), 15, "the 8 freed pods gone")
    newcomers = [pod(f"new-{i}", name, pool, gpus=1) for i in range(10)]
    create_pods(kube.core, ns, newcomers, concurrency=8)
    revision = kube.cluster.compact_etcd()
    restart_s = kube.cluster.restart_apiserver()
    proxy.set_mode(PASS)
    opened = time.monotonic()

    def settled() -> bool:
        placed = {n: at for n, at in bound_pods(kube, ns).items() if n.startswith("new-")}
        return len(placed) >= 8 or any(at in doomed for at in placed.values())

    settle(settled, 10, "8 newcomers bound", interval=0.2)
    took = time.monotonic() - opened
    placed = {n: at for n, at in bound_pods(kube, ns).items() if n.startswith("new-")}

    def deleted_named() -> list[str]:
        text = scheduler.metrics()
        return [d for d in doomed if f'node="{d}"' in text]

    settle(lambda: not deleted_named(), 12, "", interval=0.5)
    still_named = deleted_named()
    figures: dict[str, Any] = {
        "faults_injected": {"cut_s": round(opened - cut_at, 1), "etcd_compacted_to": revision,
                            "apiserver_restart_s": round(restart_s, 1), "connections_severed": proxy.severed},
        "newcomers_bound": len(placed), "newcomers_on_survivors": sum(at in survivors for at in placed.values()),
        "newcomers_on_deleted_nodes": sorted(n for n, at in placed.items() if at in doomed),
        "seconds_to_bind_after_reconnect": round(took, 1), "metrics_naming_deleted_nodes": still_named,
    }
    # the point of the compaction and restart: the resumed watches are refused (410 Gone), not replayed.
    # A watch is logged when its answer ends, which may come after the pods above were bound: wait for it.

    def gone_watches() -> list[str]:
        return sorted({r.path.rsplit("/", 1)[-1] for r in proxy.snapshot()
                       if r.sent_at >= cut_wall and "watch=true" in r.query and r.gone})

    settle(lambda: {"pods", "nodes"} <= set(gone_watches()), 15, "", interval=0.5)
    figures["watches_answered_410"] = gone_watches()
    # from the cut on: a watch reconnecting as the proxy opens may have reached it a moment before
    after = [r for r in proxy.snapshot() if r.sent_at >= cut_wall]
    bindings = [r for r in after if BINDING.match(r.path)]
    try:
        assert {"pods", "nodes"} <= set(figures["watches_answered_410"]), (
            f"the resumed pod and node watches were not answered 410 Gone "
            f"({figures['watches_answered_410']}): the gap was replayed, not re-listed; nothing was tested")
        audit(kube, ns, [scheduler], deleted_nodes=doomed, bindings=bindings, figures=figures)
        on_survivors = sum(at in survivors for at in placed.values())
        assert on_survivors == 8, (
            f"{on_survivors} of the 8 GPUs freed in the gap used within 10 s of reconnecting "
            f"(newcomers bound: {placed})")
        assert not still_named, f"the scheduler's metrics still name deleted nodes {still_named}"
        assert len(unbound_unreported(kube, ns)) == 0, "pending pods without a FailedScheduling Event"
    finally:
        figures["wall_s"] = round(time.monotonic() - began, 1)
        report(tmp_path, "watch-gap", figures)


def test_lost_binding_responses_allocate_nothing_twice(
    faults: ClusterClient, ns: str, cleanup: list[Any], tmp_path: Path
) -> None:
    """20 % of the Bindings' answers are lost (the Binding itself reaches the apiserver), 500 pods in a
    burst on 64 nodes of 8 GPUs: no GPU twice, every pod bound or told why."""
    kube = faults
    began = time.monotonic()
    pool = unique("lost")
    add_pool_nodes(kube, pool, "dgx-h100", 64)
    name = unique("lost")
    scheduler, proxy = proxied_scheduler(kube, name, tmp_path, "scheduler", cleanup)
    proxy.drop_binding_responses(0.2, seed=16)
    manifests = [pod(f"p-{i}", name, pool, gpus=1) for i in range(500)]
    create_pods(kube.core, ns, manifests, concurrency=16)
    created = time.monotonic()

    def done() -> bool:
        return len(bound_pods(kube, ns)) >= len(manifests)

    settle(done, 90, "500 pods bound", interval=1.0)
    burst_s = time.monotonic() - created
    proxy.drop_binding_responses(0.0)
    bindings = [r for r in proxy.snapshot() if BINDING.match(r.path)]
    statuses: dict[int, int] = defaultdict(int)
    for r in bindings:
        statuses[r.status] += 1
    lost = unbound_unreported(kube, ns)
    bound = bound_pods(kube, ns)
    figures: dict[str, Any] = {
        "pods": len(manifests), "bound": len(bound), "lost_pods": len(lost),
        "faults_injected": {"binding_answers_dropped": proxy.dropped},
        "bindings_sent": len(bindings), "binding_statuses": dict(statuses), "burst_s": round(burst_s, 1),
    }
    try:
        audit(kube, ns, [scheduler], figures=figures)
        assert not lost, f"{len(lost)} pods neither bound nor reported: {lost[:10]}"
        assert len(bound) == len(manifests), f"{len(bound)} of {len(manifests)} pods bound (all fit)"
    finally:
        figures["wall_s"] = round(time.monotonic() - began, 1)
        report(tmp_path, "lost-responses", figures)


def test_partitioned_leader_writes_nothing_after_its_lease(
    faults: ClusterClient, ns: str, cleanup: list[Any], tmp_path: Path
) -> None:
    """Two replicas, binds in flight; the leader's proxy black-holes it for 10 s (longer than the 6 s
    lease, shorter than the 15 s request timeout), then lets through what its connections still carry.
    The standby takes over; no write of the old leader reaches the apiserver after its lease expired (its
    last renewal seen at its proxy + 6 s), and no GPU goes to two pods."""
    kube = faults
    began = time.monotonic()
    pool = unique("part")
    add_pool_nodes(kube, pool, "dgx-h100", 16)
    name = unique("part")
    a, proxy_a = proxied_scheduler(kube, name, tmp_path, "replica-a", cleanup, *LEASE, "--identity", "replica-a")
    b, proxy_b = proxied_scheduler(kube, name, tmp_path, "replica-b", cleanup, *LEASE, "--identity", "replica-b")
    leader, standby = wait_until(
        lambda: next(((s, o) for s, o in ((a, b), (b, a)) if s.metric("gpupool_scheduler_leader") == 1), None),
        30, "a leader")
    leader_proxy = proxy_a if leader is a else proxy_b
    old = leader_proxy.label
    manifests = [pod(f"p-{i}", name, pool, gpus=1) for i in range(120)]
    create_pods(kube.core, ns, manifests, concurrency=16)
    wait_until(lambda: len(bound_pods(kube, ns)) >= 10, 60, "the first binds", interval=0.1)
    leader_proxy.set_mode(BLACKHOLE)
    cut_wall = time.time()
    cut = time.monotonic()
    took_over = wait_until(lambda: standby.metric("gpupool_scheduler_leader") == 1 and time.monotonic(), 30,
                           "the standby to lead", interval=0.2) - cut
    time.sleep(max(0.0, 10.0 - (time.monotonic() - cut)))
    leader_proxy.set_mode(PASS)
    healed_wall = time.time()
    settle(lambda: len(bound_pods(kube, ns)) >= len(manifests), 60, "all 120 pods bound", interval=0.5)
    time.sleep(2.0)  # late writes of the old leader, if any, come right after the heal
    records = leader_proxy.snapshot()
    # The old leader's lease runs out LEASE_DURATION_S after its last renewal that the apiserver accepted
    # before the partition healed. Until it wins the Lease again (an accepted Lease write, if ever), none of its
    # writes may arrive.
    renewals = [r for r in records if r.is_write and "/leases/" in r.path and r.status in (200, 201)]
    last_renew = max((r.sent_at for r in renewals if r.sent_at < healed_wall), default=cut_wall)
    expiry = last_renew + LEASE_DURATION_S
    won_again = min((r.sent_at for r in renewals if r.sent_at > expiry), default=float("inf"))
    late = [r for r in records if r.is_write and expiry < r.sent_at < won_again]
    harmless = [r for r in late if "/leases/" in r.path and r.status == 409]  # refused: stale resourceVersion
    violations = [r for r in late if r not in harmless]
    kinds: dict[str, int] = defaultdict(int)
    for r in violations:
        kinds[f"{r.method} {r.path.rsplit('/', 1)[-1]} {r.status}"] += 1
    figures: dict[str, Any] = {
        "pods": len(manifests), "bound": len(bound_pods(kube, ns)), "old_leader": old,
        "faults_injected": {"blackhole_s": round(healed_wall - cut_wall, 1)},
        "standby_took_over_after_s": round(took_over, 1),
        "old_leader_last_renew_before_cut_s": round(cut_wall - last_renew, 2),
        "old_leader_writes_after_lease_expiry": len(violations), "late_writes_by_kind": dict(kinds),
        "late_lease_writes_refused": len(harmless), "old_leader_won_the_lease_again": won_again < float("inf"),
        "first_late_write_after_expiry_s": round(min(r.sent_at for r in violations) - expiry, 2) if violations
        else None,
        "lost_pods": len(unbound_unreported(kube, ns)),
    }
    try:
        assert took_over <= LEASE_DURATION_S + 3, f"standby took over after {took_over:.1f}s"
        audit(kube, ns, [a, b], figures=figures)
        assert not violations, (
            f"{len(violations)} writes of the deposed leader {old} reached the apiserver after its lease expired "
            f"(last renewal {time.strftime('%H:%M:%S', time.localtime(last_renew))} + {LEASE_DURATION_S:.0f}s): "
            f"{dict(kinds)}; first {min(r.sent_at for r in violations) - expiry:.2f}s after expiry")
        assert figures["bound"] == len(manifests), f"{figures['bound']} of {len(manifests)} pods bound (all fit)"
    finally:
        figures["wall_s"] = round(time.monotonic() - began, 1)
        report(tmp_path, "partition", figures)


def test_apiserver_restart_mid_burst(faults: ClusterClient, ns: str, cleanup: list[Any], tmp_path: Path) -> None:
    """kube-apiserver stops for 20 s in the middle of a 120-pod burst, then starts again: the scheduler, the
    device plugins of two plugin nodes (and their kubelet stand-ins) recover on their own, everything that
    fits binds, pods that fit nowhere are reported, and the plugins acknowledge what is bound after the
    restart with exactly its assignment."""
    kube = faults
    began = time.monotonic()
    pool = unique("restart")
    add_pool_nodes(kube, pool, "dgx-h100", 16)
    name = unique("restart")
    # nodes (l40s-pcie: 4 GPUs, 44 memory units each) that each run the real device plugin behind a kubelet
    # stand-in (PodResources on: no gate), as test_scheduler_fullpath's
    with plugin_pool(kube, tmp_path, "plug", pod_resources=True, kubelet=RecoveringKubelet,
                     plugin_env=other_source) as plugged:
        scheduler, proxy = proxied_scheduler(kube, name, tmp_path, "scheduler", cleanup)

        def plugin_pods(tag: str) -> list[dict[str, Any]]:
            return [pod(f"{tag}-gpu-{i}", name, plugged.name, gpus=1) for i in range(2)] + [
                pod(f"{tag}-mem-{i}", name, plugged.name, units=8) for i in range(2)]

        before = plugin_pods("plug-before")
        create_pods(kube.core, ns, before)
        plugged.wait_acked({f"{ns}/{m['metadata']['name']}" for m in before}, timeout_s=60)
        fits = [pod(f"p-{i}", name, pool, gpus=1) for i in range(120)]
        too_big = [pod(f"too-big-{i}", name, pool, gpus=16) for i in range(3)]  # fit no node: reported
        # The scheduler binds 120 pods in about a second: the apiserver stops as soon as the last of the burst
        # is created, while most of its Bindings and reports are still to be sent.
        create_pods(kube.core, ns, fits[:20])
        wait_until(lambda: sum(n.startswith("p-") for n in bound_pods(kube, ns)) >= 20, 60, "the first 20 binds",
                   interval=0.1)
        create_pods(kube.core, ns, fits[20:] + too_big, concurrency=16)
        stopped_wall = time.time()
        kube.cluster.stop_apiserver()
        stopped = time.monotonic()
        bound_at_stop = sum(1 for r in proxy.snapshot()
                            if BINDING.match(r.path) and r.status == 201 and r.answered_at < stopped_wall)
        time.sleep(20.0)
        kube.cluster.start_apiserver()
        down_s = time.monotonic() - stopped
        restarted = time.monotonic()
        after = plugin_pods("plug-after")
        create_pods(kube.core, ns, after)
        settle(lambda: sum(n.startswith("p-") for n in bound_pods(kube, ns)) >= len(fits), 60)
        recovered_s = time.monotonic() - restarted
        bound = bound_pods(kube, ns)
        burst_bound = sum(n.startswith("p-") for n in bound)
        acked_error = ""
        try:
            plugged.wait_acked({f"{ns}/{m['metadata']['name']}" for m in before + after}, timeout_s=30)
        except AssertionError as exc:
            acked_error = str(exc)[:600]
        names = [m["metadata"]["name"] for m in too_big]

        def unreported_now() -> list[str]:
            return [n for n in names if not events_for(kube, ns, n, "FailedScheduling")]

        # client-go's event recorder retries a failed Event every 10 s (12 tries): 30 s after the restart
        settle(lambda: not unreported_now(), max(0.0, 30 - (time.monotonic() - restarted)))
        unreported = unreported_now()
        plugins_alive = {n.name: n.plugin.proc is not None and n.plugin.proc.poll() is None
                         for n in plugged.nodes.values()}
        figures: dict[str, Any] = {
            "pods_that_fit": len(fits), "bound": burst_bound, "bound_at_stop": bound_at_stop,
            "faults_injected": {"apiserver_down_s": round(down_s, 1)},
            "seconds_to_bind_all_after_restart": round(recovered_s, 1),
            "scheduler_alive": scheduler.process.poll() is None, "plugins_alive": plugins_alive,
            "plugin_pods_acked_error": acked_error or None, "unfit_pods_unreported": unreported,
            "kubelet_standin_outages": sum(len(getattr(k, "outages", ())) for k in plugged.kubelets()),
            "lost_pods": len(unbound_unreported(kube, ns)),
        }
        try:
            assert bound_at_stop < len(fits), "the apiserver stopped after the burst was bound: nothing was tested"
            assert scheduler.process.poll() is None, f"the scheduler exited:\n{scheduler.tail()}"
            assert scheduler.get("/readyz")[0] == 200, "the scheduler is not ready again"
            assert all(plugins_alive.values()), f"a device plugin exited: {plugins_alive}"
            for n in plugged.nodes.values():
                n.plugin.wait_healthz(200, timeout=15)
            assert burst_bound == len(fits), (
                f"{burst_bound} of {len(fits)} pods bound 60 s after the apiserver came back")
            assert not acked_error, f"plugin pods not admitted and acknowledged after the restart: {acked_error}"
            assert not unreported, f"pods that fit nowhere never reported (FailedScheduling): {unreported}"
            audit(kube, ns, [scheduler], figures=figures)
        finally:
            figures["wall_s"] = round(time.monotonic() - began, 1)
            report(tmp_path, "apiserver-restart", figures)
