"""GpuQuotas in the scheduler (scheduler/quotas.py): validation, namespaces, usage from the ledger, the
cycle's questions, gauges, and the status written to the real API server (deploy/crds installed)."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, start_wsgi_server
from prometheus_client.parser import text_string_to_metric_families

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.idle import IdlePolicy
from gpupool_sched.framework.plugins.quotas import (
    GROUP,
    PLURAL,
    VERSION,
    InvalidQuota,
    QuotaBook,
    parse_quota,
)
from gpupool_sched.kube.kubeapi import KubeApi
from gpupool_sched.kube.labelselector import LabelSelector
from gpupool_sched.kube.podspec import PodPlan
from gpupool_sched.kube.watch import build_registry
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.preemption import RunningPod
from gpupool_sched.placement.quota import Amount, Verdict, admit
from gpupool_sched.scheduler.service import SchedulerConfig, SchedulerService
from gpupool_sched.writer.status import StatusWriter
from tests.support.objects import bump, node_obj, nominated, ns_obj, pod_obj, quota_obj, team_spec, terminating
from tests.support.waiting import eventually

if TYPE_CHECKING:
    from gpupool_devcluster.client import ClusterClient

GB = 1024


def plan(namespace: str, name: str, *, gpus: int = 0, units: int = 0, priority: int = 0) -> PodPlan:
    if gpus:
        request = PodRequest(name=name, gpu_count=gpus, gpu_milli=1000, namespace=namespace, priority=priority)
    elif units:
        request = PodRequest(name=name, gpu_count=1, gpu_memory_mib=units * GB, namespace=namespace, priority=priority)
    else:
        request = PodRequest(name=name, cpu_milli=100, namespace=namespace, priority=priority)
    return PodPlan(f"uid-{namespace}-{name}", namespace, name, 0.0, priority, request, (), GB)


def place(state: ClusterState, p: PodPlan, gpus: tuple[int, ...] = (), share_units: int = 0) -> Placement:
    if share_units:
        placement = Placement("n0", gpus, share_units * 1000 // 80, share_units * GB)
    else:
        placement = Placement("n0", gpus, 1000 if gpus else 0, 80 * GB if gpus else 0)
    state.assume(p, placement)
    return placement


def book_with(*quotas: dict[str, Any], namespaces: tuple[dict[str, Any], ...] = ()) -> QuotaBook:
    book = QuotaBook(ClusterState("gpupool"))
    for ns in namespaces:
        book.on_namespace("ADDED", ns)
    for obj in quotas:
        book.on_quota("ADDED", obj)
    return book


# ---- validation -----------------------------------------------------------------------------------

def test_a_valid_quota_parses() -> None:
    spec = parse_quota(quota_obj("a", {
        "namespaceSelector": {"matchLabels": {"team": "a"},
                              "matchExpressions": [{"key": "tier", "operator": "In", "values": ["x", "y"]},
                                                   {"key": "gpupool.io/off", "operator": "DoesNotExist"}]},
        "guaranteed": {"gpus": 8, "memoryUnits": 40}}))
    assert spec.guaranteed == Amount(8, 40) and spec.borrowing_limit == Amount()
    assert spec.selector.matches({"team": "a", "tier": "y"})
    assert not spec.selector.matches({"team": "a", "tier": "z"})
    assert not spec.selector.matches({"team": "a", "tier": "x", "gpupool.io/off": ""})
    assert LabelSelector().matches({})  # {} selects every namespace


@pytest.mark.parametrize(("spec", "problems"), [
    ({"namespaceSelector": {}, "guaranteed": {"gpu": 4}},
     ["unknown field spec.guaranteed.gpu (known: gpus, memoryUnits)"]),
    ({"namespaceSelector": {}, "guaranteed": {"gpus": -1}, "borrowingLimit": {"memoryUnits": "2"}},
     ["spec.guaranteed.gpus must not be negative (-1)", "spec.borrowingLimit.memoryUnits must be a whole number, "
                                                        "not '2'"]),
    ({"namespaceSelector": {}, "guaranteed": {"gpus": 1.5}}, ["spec.guaranteed.gpus must be a whole number, not 1.5"]),
    ({"namespaceSelector": {}, "guaranteed": {"gpus": True}}, ["must be a whole number, not True"]),
    ({"namespaceSelector": {}}, ["spec.guaranteed is required"]),
    ({"guaranteed": {"gpus": 1}}, ["spec.namespaceSelector is required ({} selects every namespace)"]),
    ({"namespaceSelector": {"matchLabel": {"team": "a"}}, "guaranteed": {}},
     ["unknown field spec.namespaceSelector.matchLabel"]),
    ({"namespaceSelector": {"matchLabels": {"team": "not a value!"}}, "guaranteed": {}},
     ["spec.namespaceSelector.matchLabels[team]: 'not a value!' is not a valid label value"]),
    ({"namespaceSelector": {"matchLabels": {"/bad": "x"}}, "guaranteed": {}}, ["'/bad' is not a valid label key"]),
    ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": []}]}, "guaranteed": {}},
     ["spec.namespaceSelector.matchExpressions[0]: operator In needs at least one value"]),
    ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Exists", "values": ["a"]}]},
      "guaranteed": {}}, ["operator Exists takes no values"]),
    ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Equals", "values": ["a"]}]},
      "guaranteed": {}}, ["operator must be one of In, NotIn, Exists, DoesNotExist, not 'Equals'"]),
    ({"namespaceSelector": {"matchExpressions": "team=a"}, "guaranteed": {}},
     ["spec.namespaceSelector.matchExpressions must be a list"]),
    ({"namespaceSelector": {}, "guaranteed": {}, "borrowLimit": {"gpus": 2}}, ["unknown field spec.borrowLimit"]),
    ({"namespaceSelector": {}, "guaranteed": {}, "idleReclaim": {"idleAfter": "an hour", "action": "kill"}},
     ["spec.idleReclaim.action must be one of none, report, reclaimWhenNeeded, reclaim, not 'kill'",
      "spec.idleReclaim.idleAfter: 'an hour' is not a duration"]),
    ({"namespaceSelector": {}, "guaranteed": {}, "idleReclaim": "1h"},
     ["spec.idleReclaim must be an object with idleAfter and action"]),
])
def test_invalid_quotas_name_every_problem(spec: dict[str, Any], problems: list[str]) -> None:
    with pytest.raises(InvalidQuota) as caught:
        parse_quota(quota_obj("bad", spec))
    for problem in problems:
        assert problem in str(caught.value)


def test_a_quotas_idle_policy_governs_its_namespaces() -> None:
    spec = {**team_spec("a", 1), "idleReclaim": {"idleAfter": "30m"}}
    book = book_with(quota_obj("a", spec), quota_obj("b", team_spec("b", 1)),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b"), ns_obj("free")))
    assert book.idle_policy("ns-a") == IdlePolicy("reclaimWhenNeeded", 1800.0, "GpuQuota a")  # the default action
    assert book.idle_policy("ns-b") is None  # a quota without idleReclaim: the scheduler's default
    assert book.idle_policy("free") is None
    assert book.idle_policy("unknown") is None


def test_within_guarantee_names_the_quota_only_while_the_team_would_not_borrow() -> None:
    book = book_with(quota_obj("a", team_spec("a", 2, borrow=4)), namespaces=(ns_obj("ns-a", team="a"), ns_obj("free")))
    assert book.within_guarantee([plan("ns-a", "p", gpus=2)]) == "a"
    assert book.within_guarantee([plan("ns-a", "p", gpus=3)]) is None  # it would borrow
    assert book.within_guarantee([plan("free", "p", gpus=1)]) is None  # no quota governs it


def test_an_invalid_quota_is_ignored_and_reported() -> None:
    book = book_with(quota_obj("a", team_spec("a", 1)),
                     quota_obj("b", {"namespaceSelector": {"matchLabels": {"team": "b"}}, "guaranteed": {"gpus": -2}}),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    assert [q.name for q in book.quotas()] == ["a"]
    assert book.check(plan("ns-b", "p", gpus=64)).ok  # b is ignored: its namespace is not limited
    assert not book.check(plan("ns-a", "p", gpus=2)).ok  # a still holds
    status = book.desired_status("b")
    assert status["conditions"] == [{
        "type": "Valid", "status": "False", "reason": "InvalidSpec",
        "message": "ignored: spec.guaranteed.gpus must not be negative (-2)", "observedGeneration": 1}]
    assert book.desired_status("a")["conditions"][0]["status"] == "True"


# ---- namespaces, usage, the cycle's questions ------------------------------------------------------

def test_namespaces_follow_their_labels() -> None:
    book = book_with(quota_obj("a", team_spec("a", 1)), namespaces=(ns_obj("x"),))
    assert book.quotas()[0].namespaces == frozenset()
    book.on_namespace("MODIFIED", ns_obj("x", team="a"))
    assert book.quotas()[0].namespaces == {"x"}
    book.on_namespace("DELETED", ns_obj("x", team="a"))
    assert book.quotas()[0].namespaces == frozenset()
    by_name = book_with(quota_obj("n", {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}},
                                        "guaranteed": {"gpus": 1}}), namespaces=(ns_obj("y"), ns_obj("z")))
    assert by_name.quotas()[0].namespaces == {"y"}


def test_usage_comes_from_the_ledger() -> None:
    book = book_with(quota_obj("a", team_spec("a", 4, 16)), quota_obj("b", team_spec("b", 4)),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b"), ns_obj("free")))
    state = book.state
    place(state, plan("ns-a", "train", gpus=2), (0, 1))
    place(state, plan("ns-a", "infer", units=6), (2,), share_units=6)
    place(state, plan("ns-b", "train", gpus=1), (3,))
    place(state, plan("free", "big", gpus=4), (4, 5, 6, 7))
    assert book.usage() == {"a": Amount(2, 6), "b": Amount(1, 0)}
    state.forget("uid-ns-a-train")
    assert book.usage() == {"a": Amount(0, 6), "b": Amount(1, 0)}


def test_check_refuses_over_quota_with_the_quota_and_the_excess() -> None:
    book = book_with(quota_obj("team-a", team_spec("a", 8)), quota_obj("team-b", team_spec("b", 8)),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    for i in range(6):
        place(book.state, plan("ns-a", f"p{i}", gpus=1), (i,))
    assert book.check(plan("ns-a", "fits", gpus=2)).ok
    verdict = book.check(plan("ns-a", "big", gpus=4))
    assert not verdict.ok and verdict.quota == "team-a"
    assert verdict.message == ("GpuQuota team-a: needs 4 GPUs, uses 6 of 8 guaranteed and may borrow 0 more "
                               "(borrowing limit 0, 8 idle in the other quotas): 2 over")
    assert book.check(plan("ns-a", "cpu")).ok
    assert book.check(plan("elsewhere", "any", gpus=100)).ok
    gang = [plan("ns-a", "g0", gpus=1), plan("ns-a", "g1", gpus=1), plan("ns-a", "g2", gpus=1)]
    assert not book.check_gang(gang).ok and book.check_gang(gang[:2]).ok
    with pytest.raises(ValueError, match="one namespace"):
        book.check_gang([plan("ns-a", "x", gpus=1), plan("ns-b", "y", gpus=1)])


def test_admit_gang_admits_members_in_order_while_the_quota_allows() -> None:
    """Issue 16 A4, the book's half: every member bound must pass admission, not just the minimum."""
    book = book_with(quota_obj("a", team_spec("a", 2)), quota_obj("b", team_spec("b", 1)),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    gang = [plan("ns-a", f"g{i}", gpus=1) for i in range(4)]
    count, verdict = book.admit_gang(gang, 2)
    assert count == 2 and not verdict.ok and verdict.quota == "a"
    assert verdict.message.startswith("GpuQuota a: needs 1 GPU, uses 2 of 2 guaranteed")  # the 3rd, after 2
    count, verdict = book.admit_gang(gang, 3)
    assert count == 0 and "needs 3 GPUs, uses 0 of 2 guaranteed" in verdict.message
    assert book.admit_gang(gang[:2], 2) == (2, book.check_gang(gang[:2]))
    lender = book_with(quota_obj("a", team_spec("a", 2, borrow=1)), quota_obj("b", team_spec("b", 1)),
                       namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    assert lender.admit_gang(gang, 2)[0] == 3  # one more, borrowed from b's idle guarantee
    assert book.admit_gang([plan("free", f"f{i}", gpus=8) for i in range(3)], 1) == (3, Verdict(True))


def test_borrowing_and_reclaim_through_the_book() -> None:
    """Scenario 4c's decisions: a borrows b's idle GPUs; b's pod gets a's borrowed pods as candidates."""
    book = book_with(quota_obj("a", team_spec("a", 2, borrow=4)), quota_obj("b", team_spec("b", 4)),
                     namespaces=(ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    state = book.state
    running = []
    for i in range(6):
        p = plan("ns-a", f"a{i}", gpus=1, priority=i % 2)
        assert book.check(p).ok, i  # 2 guaranteed, 4 borrowed of b's idle 4
        placement = place(state, p, (i,))
        running.append(RunningPod(p.uid, "n0", p.priority, p.request, placement, float(i)))
    assert book.usage()["a"] == Amount(6, 0)
    assert not book.check(plan("ns-a", "more", gpus=1)).ok  # borrowing limit reached and b's 4 are lent
    b_pod = plan("ns-b", "b0", gpus=2)
    assert book.check(b_pod).ok  # within b's guarantee, whatever a borrowed
    victims = book.reclaim(b_pod, running)
    # a borrows 4: its priority-0 pods a4, a2, a0 (newest first), then the newest priority-1 one, a5
    assert [v.uid for v in victims] == ["uid-ns-a-a4", "uid-ns-a-a2", "uid-ns-a-a0", "uid-ns-a-a5"]
    assert book.reclaim(plan("ns-a", "x", gpus=1), running) == []  # a borrower does not reclaim
    assert book.desired_status("a")["borrowed"] == {"gpus": 4, "memoryUnits": 0}


def test_overlapping_quotas_say_which_one_governs() -> None:
    book = book_with(quota_obj("b-team", team_spec("shared", 1)), quota_obj("a-team", team_spec("shared", 3)),
                     namespaces=(ns_obj("common", team="shared"),))
    assert book.check(plan("common", "p", gpus=3)).ok  # a-team governs: 3 guaranteed
    status = book.desired_status("b-team")
    overlap = next(c for c in status["conditions"] if c["type"] == "Overlapping")
    assert overlap["status"] == "True" and "common (by GpuQuota a-team)" in overlap["message"]
    assert status["namespaces"] == []
    assert book.desired_status("a-team")["namespaces"] == ["common"]


def test_watch_registers_quota_and_namespace_handlers() -> None:
    service = SchedulerService(SchedulerConfig(), KubeApi(client.ApiClient(client.Configuration())))
    assert isinstance(service.quotas, QuotaBook)
    names = {h.selector.any_name for h in build_registry(service)._watching.get_all_handlers() if h.selector}
    assert {"gpuquotas", "namespaces"} <= names


def test_gauges_per_team_over_http() -> None:
    registry = CollectorRegistry()
    book = QuotaBook(ClusterState("gpupool"), registry)
    book.on_namespace("ADDED", ns_obj("ns-a", team="a"))
    book.on_quota("ADDED", quota_obj("a", team_spec("a", 1, 4, borrow=2)))
    book.on_quota("ADDED", quota_obj("bad", {"namespaceSelector": {}, "guaranteed": {"gpus": -1}}))
    place(book.state, plan("ns-a", "p", gpus=2), (0, 1))
    book._set_gauges(book.usage())
    httpd, thread = start_wsgi_server(0, "127.0.0.1", registry)
    try:
        port = httpd.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        httpd.shutdown()
        thread.join(5)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    a_gpus = (("quota", "a"), ("resource", "gpus"))
    assert samples[("gpupool_scheduler_quota_used", a_gpus)] == 2
    assert samples[("gpupool_scheduler_quota_borrowed", a_gpus)] == 1
    assert samples[("gpupool_scheduler_quota_guaranteed", (("quota", "a"), ("resource", "memory_units")))] == 4
    assert samples[("gpupool_scheduler_quota_borrowing_limit", a_gpus)] == 2
    assert samples[("gpupool_scheduler_quota_valid", (("quota", "bad"),))] == 0
    assert ("gpupool_scheduler_quota_used", (("quota", "bad"), ("resource", "gpus"))) not in samples
    book.on_quota("DELETED", quota_obj("a", {}))
    book._set_gauges(book.usage())
    assert registry.get_sample_value("gpupool_scheduler_quota_used", {"quota": "a", "resource": "gpus"}) is None


# ---- on the real API server ----------------------------------------------------------------------

@pytest.fixture
def quotas_api(kube: ClusterClient) -> Iterator[client.CustomObjectsApi]:
    from gpupool_devcluster.crds import install_crds

    assert "gpuquotas.gpupool.io" in install_crds(kube.api_client)
    yield client.CustomObjectsApi(kube.api_client)


def _create(custom: client.CustomObjectsApi, name: str, spec: dict[str, Any], made: list[str]) -> None:
    custom.create_cluster_custom_object(GROUP, VERSION, PLURAL,
                                        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota",
                                         "metadata": {"name": name}, "spec": spec})
    made.append(name)


@pytest.mark.e2e  # the real API server: the session's dev cluster
def test_status_on_the_api_server(kube: ClusterClient, namespace: str, quotas_api: client.CustomObjectsApi) -> None:
    tag = uuid.uuid4().hex[:6]
    kube.core.patch_namespace(namespace, {"metadata": {"labels": {"gpupool.io/test-team": tag}}})
    custom = quotas_api
    good, typo, empty_in = f"q-{tag}-good", f"q-{tag}-typo", f"q-{tag}-in"
    made: list[str] = []
    try:
        _create(custom, good, {"namespaceSelector": {"matchLabels": {"gpupool.io/test-team": tag}},
                               "guaranteed": {"gpus": 2, "memoryUnits": 8}, "borrowingLimit": {"gpus": 1}}, made)
        _create(custom, typo, {"namespaceSelector": {"matchLabels": {"gpupool.io/test-team": tag}},
                               "guaranteed": {"gpu": 2}}, made)  # misspelt: kept by the schema, caught here
        _create(custom, empty_in, {"namespaceSelector": {"matchExpressions": [
            {"key": "gpupool.io/test-team", "operator": "In", "values": []}]}, "guaranteed": {"gpus": 1}}, made)
        with pytest.raises(ApiException) as refused:  # what the schema can say, the API server says
            _create(custom, f"q-{tag}-neg", {"namespaceSelector": {}, "guaranteed": {"gpus": -1}}, made)
        assert refused.value.status == 422 and "spec.guaranteed.gpus" in str(refused.value.body)

        api = KubeApi(kube.api_client)
        book = QuotaBook(ClusterState("gpupool"))
        statuses = StatusWriter(api)
        p = plan(namespace, "train", gpus=3)

        async def publish() -> int:
            await book.resync(api)
            place(book.state, p, (0, 1, 2))
            return await statuses.quotas(book)

        try:
            assert asyncio.run(publish()) >= 3
            again = asyncio.run(statuses.quotas(book))  # nothing changed: the same status is not written again
        finally:
            api.close()
        assert again == 0
        assert [q.name for q in book.quotas() if q.name.startswith(f"q-{tag}")] == [good]

        def status(name: str) -> dict[str, Any]:
            return custom.get_cluster_custom_object_status(GROUP, VERSION, PLURAL, name).get("status") or {}

        def condition(name: str, kind: str = "Valid") -> dict[str, Any]:
            return next((c for c in status(name).get("conditions") or () if c["type"] == kind), {})

        eventually(lambda: condition(good).get("status") == "True", 10, "good quota Valid")
        shown = status(good)
        assert shown["used"] == {"gpus": 3, "memoryUnits": 0} and shown["borrowed"] == {"gpus": 1, "memoryUnits": 0}
        assert shown["namespaces"] == [namespace]
        assert condition(good)["observedGeneration"] == 1 and condition(good)["lastTransitionTime"]
        bad = condition(typo)
        assert bad["status"] == "False" and bad["reason"] == "InvalidSpec"
        assert "unknown field spec.guaranteed.gpu (known: gpus, memoryUnits)" in bad["message"]
        assert status(typo)["used"] == {"gpus": 0, "memoryUnits": 0}
        assert "operator In needs at least one value" in condition(empty_in)["message"]
        # the invalid ones changed nothing: the good one governs the namespace alone
        assert not condition(good, "Overlapping") or condition(good, "Overlapping")["status"] == "False"
        verdict = book.check(plan(namespace, "more", gpus=1))
        assert not verdict.ok and verdict.message.startswith(f"GpuQuota {good}: needs 1 GPU, uses 3 of 2 guaranteed")
    finally:
        for name in made:
            try:
                custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise


# ---- the whole service: the quota check in the cycle, on a fake API (writes recorded, never sent) -------

class RecordingApi(KubeApi):
    """Every write (Bindings, Events, pod status, evictions) is recorded and answered 200."""

    def __init__(self) -> None:
        super().__init__(client.ApiClient(client.Configuration()), workers=1)
        self.writes: list[tuple[str, str, Any]] = []

    async def write(self, method: str, api_path: str, body: Any, content_type: str = "") -> None:
        self.writes.append((method, api_path, body))

    def bound(self) -> list[str]:
        return [body["metadata"]["name"] for method, p, body in self.writes if p.endswith("/bindings")]

    def events(self, reason: str = "FailedScheduling") -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for _, p, body in self.writes:
            if p.endswith("/events") and body.get("reason") == reason:
                out.setdefault(body["involvedObject"]["name"], []).append(body["message"])
        return out


def service_pod(name: str, namespace: str, *, gpus: int = 1, node: str | None = None, priority: int = 0,
                group: str | None = None, scheduler: str = "gpupool") -> dict[str, Any]:
    from gpupool_sched.framework.plugins.gangs import POD_GROUP_LABEL

    obj = pod_obj(name, gpus=gpus, node=node, scheduler=scheduler, phase="Running" if node else "Pending")
    obj["metadata"]["namespace"] = namespace
    obj["metadata"]["uid"] = f"uid-{namespace}-{name}"
    obj["metadata"]["labels"] = {POD_GROUP_LABEL: group} if group else {}
    obj["spec"]["priority"] = priority
    return obj


class Service:
    """A SchedulerService with nodes, namespaces and quotas, driven one decision at a time."""

    def __init__(self, nodes: dict[str, str], quotas: tuple[dict[str, Any], ...],
                 namespaces: tuple[dict[str, Any], ...]) -> None:
        self.api = RecordingApi()
        self.svc = SchedulerService(SchedulerConfig(), self.api)
        for name, profile in nodes.items():
            self.svc.on_node("ADDED", node_obj(name, profile))
        for ns in namespaces:
            self.svc.quotas.on_namespace("ADDED", ns)
        for obj in quotas:
            self.svc.quotas.on_quota("ADDED", obj)
        self.pods: dict[str, dict[str, Any]] = {}

    def add(self, *objs: dict[str, Any]) -> None:
        for obj in objs:
            self.pods[obj["metadata"]["name"]] = obj
            self.svc.on_pod("ADDED", obj)

    def delete(self, name: str) -> None:
        self.svc.on_pod("DELETED", bump(self.pods[name]))

    async def run(self, limit: int = 100) -> int:
        """Decide for every pod the queue offers now (after their backoff, which the test skips)."""
        decided = 0
        if not self.svc.recorder._tasks:
            self.svc.recorder.start()
        self.svc.queue.flush()
        while decided < limit:
            self.svc.queue._flush_backoff(float("inf"))
            item = self.svc.queue.pop()
            if item is None:
                break
            self.svc.schedule_one(item)
            decided += 1
        await self.svc.binder.drain()
        await self.svc.preemptor.drain()
        await self.svc.recorder.flush()
        return decided


def gang_group(name: str, namespace: str, min_member: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"pg-{name}"},
            "spec": {"minMember": min_member}}


def test_a_gang_binds_only_the_members_its_quota_admits() -> None:
    """Issue 16 A4: a 2-GPU guaranteed quota, borrowing 0, a gang of 4 one-GPU members with minMember 2:
    2 bind (the minimum, within the quota), the other 2 wait with the quota's over-quota message."""
    world = Service({"n1": "dgx-h100"}, (quota_obj("a", team_spec("a", 2)),), (ns_obj("ns-a", team="a"),))

    async def scenario() -> None:
        world.svc.on_pod_group("ADDED", gang_group("train", "ns-a", 2))
        world.add(*(service_pod(f"w-{i}", "ns-a", group="train") for i in range(4)))
        await world.run()
        assert len(world.api.bound()) == 2, world.api.bound()
        assert world.svc.quotas.usage()["a"] == Amount(2, 0)
        waiting = sorted(set(world.pods) - set(world.api.bound()))
        events = world.api.events()
        for name in waiting:
            assert any("GpuQuota a" in m and "over" in m for m in events.get(name, [])), (name, events)
            assert world.svc.queue.where(f"uid-ns-a-{name}") == "unschedulable"
        # they stay out while the quota is full, however often they are tried
        await world.run()
        assert len(world.api.bound()) == 2 and world.svc.quotas.usage()["a"] == Amount(2, 0)
        await world.svc.recorder.stop()

    asyncio.run(scenario())


def test_a_freed_gpu_wakes_only_the_over_quota_pods_whose_quota_it_helps() -> None:
    """Issue 16 A9: a GPU freed by team a wakes a's over-quota pods, not b's (b borrows nothing, so a's
    usage is not b's room); a GPU freed outside every quota wakes no over-quota pod."""
    world = Service({"n1": "dgx-h100", "n2": "dgx-h100"},
                    (quota_obj("a", team_spec("a", 2)), quota_obj("b", team_spec("b", 2))),
                    (ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b"), ns_obj("free")))

    async def scenario() -> None:
        world.add(*(service_pod(f"{t}-run-{i}", f"ns-{t}", node="n1", scheduler="other")
                    for t in "ab" for i in range(2)))
        world.add(service_pod("free-run", "free", node="n2", scheduler="other"))
        world.add(service_pod("a-wait", "ns-a"), service_pod("b-wait", "ns-b"))
        await world.run()
        queue = world.svc.queue
        assert queue.where("uid-ns-a-a-wait") == queue.where("uid-ns-b-b-wait") == "unschedulable"
        world.delete("free-run")  # not counted by any quota: helps no over-quota pod
        assert queue.where("uid-ns-a-a-wait") == queue.where("uid-ns-b-b-wait") == "unschedulable"
        world.delete("a-run-0")
        assert queue.where("uid-ns-a-a-wait") in ("active", "backoff")
        assert queue.where("uid-ns-b-b-wait") == "unschedulable"
        await world.run()
        assert world.api.bound() == ["a-wait"]

    asyncio.run(scenario())


# ---- the incremental usage equals a full recount, whatever the ledger does -------------------------------

_TEAMS = ("ns-a", "ns-b", "ns-c", "free")


def _ledger_pod(i: int, *, bound: bool) -> dict[str, Any]:
    namespace = _TEAMS[i % len(_TEAMS)]
    return service_pod(f"p{i}", namespace, gpus=1 + i % 3, node="n1" if bound else None,
                       scheduler="other" if bound else "gpupool")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 11)), max_size=60))
def test_incremental_usage_always_equals_a_full_recount(steps: list[tuple[int, int]]) -> None:
    """Issue 16 A9: random sequences of assume / bind / confirm / forget / delete / preempt (victims turning
    into holds) / quota and namespace changes: after every step, usage() (kept as the ledger changes)
    equals recount() (the whole ledger counted again, as usage() did before)."""
    state = ClusterState("gpupool")
    state.apply_node(node_obj("n1", "dgx-h100"))
    state.apply_node(node_obj("n2", "dgx-h100"))
    book = QuotaBook(state)
    for ns, team in (("ns-a", "a"), ("ns-b", "b"), ("ns-c", "c")):
        book.on_namespace("ADDED", ns_obj(ns, team=team))
    book.on_namespace("ADDED", ns_obj("free"))
    book.on_quota("ADDED", quota_obj("a", team_spec("a", 4, 8)))
    book.on_quota("ADDED", quota_obj("b", team_spec("b", 2, borrow=2)))
    freed: list[str | None] = []
    book.on_freed = freed.append
    seen: dict[str, dict[str, Any]] = {}  # confirmed pods by uid, as the watch showed them
    for op, i in steps:
        pod_plan = plan(_TEAMS[i % len(_TEAMS)], f"q{i}", gpus=1 + i % 2, units=0)
        uid = pod_plan.uid
        before = book.usage()
        if op == 0 and uid not in state.pods and not state.is_gone(uid):
            state.assume(pod_plan, Placement("n2", tuple(range(i % 2 + 1)), 1000, 80 * GB))
        elif op == 1:
            state.mark_bound(uid)
        elif op == 2:
            state.forget(uid)
        elif op == 3:  # another scheduler's pod seen bound (devices guessed), or seen again
            obj = _ledger_pod(i, bound=True)
            obj = seen.get(obj["metadata"]["uid"]) or obj
            seen[obj["metadata"]["uid"]] = obj = bump(obj)
            state.apply_pod(obj)
        elif op == 4 and seen:  # a seen pod deleted (a victim turns into a hold when nominated)
            victim = sorted(seen)[i % len(seen)]
            state.apply_pod(bump(seen.pop(victim)), deleted=True)
        elif op == 5:  # a preemptor nominated for n1's running pods
            victims = [e.uid for e in state.entries("n1") if e.evicting_for is None and e.phase.value == "confirmed"]
            if victims and f"pre-{i}" not in state.nominations:
                state.nominate(f"pre-{i}", f"{_TEAMS[i % len(_TEAMS)]}/pre-{i}", "n1", 1000, victims[: 1 + i % 2],
                               60.0)
        elif op == 6 and state.nominations:  # a nomination ends (its holds released)
            state.end_nomination(sorted(state.nominations)[i % len(state.nominations)])
        elif op == 7:  # quotas and namespaces change: the usage is re-derived per quota
            if i % 3 == 0:
                book.on_namespace("MODIFIED", ns_obj("ns-c", team="a" if i % 2 else "c"))
            elif i % 3 == 1:
                book.on_quota("ADDED", quota_obj("c", team_spec("c", i % 4)))
            else:
                book.on_quota("DELETED", quota_obj("b", {}))
        after = book.usage()
        assert after == book.recount(), (op, i)
        for namespace in _TEAMS:  # admit()'s O(1) cohort sums agree with its O(quotas) path
            for ask in (Amount(1, 0), Amount(3, 0), Amount(0, 2)):
                assert book.check_demand(namespace, ask) == admit(book.quotas(), after, ask, namespace)
        dropped = {q for q in after.keys() & before.keys() if not before[q].within(after[q])}
        if op != 7:
            assert dropped <= set(freed), (op, i, dropped, freed)  # every drop was told
        freed.clear()


# ---- reclaim and holds (issue 16 A5) -------------------------------------------------------------------

def _evicted(api: RecordingApi) -> list[str]:
    return [p.split("/")[-2] for method, p, _ in api.writes if p.endswith("/eviction")]


def lent_node() -> Service:
    """One 8-GPU node full of team a's one-GPU pods (priority 100, another scheduler's): a is guaranteed 2 and
    borrows the other 6 from b's idle guarantee of 6."""
    world = Service({"n1": "dgx-h100"},
                    (quota_obj("a", team_spec("a", 2, borrow=8)), quota_obj("b", team_spec("b", 6))),
                    (ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b"), ns_obj("free")))
    world.add(*(service_pod(f"a-{i}", "ns-a", node="n1", scheduler="other", priority=100) for i in range(8)))
    assert world.svc.quotas.usage() == {"a": Amount(8, 0), "b": Amount()}
    return world


def test_reclaimed_gpus_count_against_the_reclaiming_team_so_a_higher_priority_borrower_cannot_take_them() -> None:
    """Issue 16 A5: b (within its guarantee) reclaims 2 of a's borrowed GPUs. While they are held for b's pod,
    they count against b: a's pods of higher priority, which would borrow them again, are over quota instead
    of taking the room (before: they took it, b preempted again and again, 6 pods evicted, b stuck)."""
    world = lent_node()

    async def scenario() -> None:
        b_pod = service_pod("b-train", "ns-b", gpus=2)
        world.add(b_pod)
        await world.run()
        victims = _evicted(world.api)
        assert len(victims) == 2 and all(v.startswith("a-") for v in victims)
        for victim in victims:
            world.delete(victim)
        # 2 GPUs free on n1, held for b's pod: counted against b, not against nobody
        assert world.svc.quotas.usage() == {"a": Amount(6, 0), "b": Amount(2, 0)}
        for round_ in range(3):  # borrowers of a, each more important than b's pod, keep coming
            world.add(service_pod(f"a-urgent-{round_}", "ns-a", gpus=2, priority=1000))
            await world.run()
            assert "b-train" in world.api.bound(), round_
        assert not [n for n in world.api.bound() if n.startswith("a-urgent")]
        assert len(_evicted(world.api)) == 2  # nobody else evicted
        events = world.api.events()
        assert all(any("GpuQuota a" in m for m in events[f"a-urgent-{r}"]) for r in range(3)), events
        assert world.svc.quotas.usage() == {"a": Amount(6, 0), "b": Amount(2, 0)}

    asyncio.run(scenario())


def test_the_preemptors_own_holds_do_not_count_twice_in_its_check() -> None:
    """b guaranteed exactly what its pod needs: its own holds are not counted against the pod itself."""
    world = Service({"n1": "dgx-h100"},
                    (quota_obj("a", team_spec("a", 6, borrow=2)), quota_obj("b", team_spec("b", 2))),
                    (ns_obj("ns-a", team="a"), ns_obj("ns-b", team="b")))
    world.add(*(service_pod(f"a-{i}", "ns-a", node="n1", scheduler="other") for i in range(8)))

    async def scenario() -> None:
        world.add(service_pod("b-train", "ns-b", gpus=2))
        await world.run()
        for victim in _evicted(world.api):
            world.delete(victim)
        assert world.svc.quotas.usage()["b"] == Amount(2, 0)  # the holds
        await world.run()
        assert world.api.bound() == ["b-train"] and world.svc.quotas.usage()["b"] == Amount(2, 0)

    asyncio.run(scenario())


def test_a_new_leader_adopts_a_reclaims_victims_whatever_their_priority() -> None:
    """Issue 16 A5, after a failover: the old leader reclaimed 2 of a's GPUs (priority 100) for b's pod
    (priority 0) and set its nominatedNodeName. The new leader holds what those victims free for b's pod,
    although they are of higher priority (before: only lower-priority victims were adopted, so a pod of
    an unlimited namespace took the room and b preempted again)."""
    world = lent_node()

    async def scenario() -> None:
        for name in ("a-6", "a-7"):  # evicted by the old leader: terminating
            world.pods[name] = terminating(world.pods[name])
            world.svc.on_pod("MODIFIED", world.pods[name])
        b_pod = nominated(service_pod("b-train", "ns-b", gpus=2), "n1")
        world.add(b_pod)
        nomination = world.svc.state.nominations.get(b_pod["metadata"]["uid"])
        assert nomination is not None and nomination.victims == {"uid-ns-a-a-6", "uid-ns-a-a-7"}
        world.delete("a-6")
        world.delete("a-7")
        world.add(service_pod("free-job", "free", gpus=2))  # not more important than b: the room is b's
        await world.run()
        assert world.api.bound() == ["b-train"]
        assert _evicted(world.api) == []  # no second preemption

    asyncio.run(scenario())
