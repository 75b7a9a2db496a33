"""The what-if's engine (simulate/dryrun.py) on offline listings, its continuation and its report; its
command's bad input. The engine is the scheduler service itself: these check what the what-if adds
(feeding back its writes, queue order, running pods accounted, victims attributed, no write sent)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client

from gpupool_deviceplugin.publication import node_publication_for_profile
from gpupool_sched.errors import UserError
from gpupool_sched.scheduler.service import SchedulerConfig
from gpupool_sched.simulate.continuation import draw, recent_mix
from gpupool_sched.simulate.dryrun import Decision, DryRunApi, Outcome, run_what_if
from gpupool_sched.simulate.whatif import candidate_config, policy_of
from gpupool_sched.simulate.whatif_report import report_json, summary
from tests.support.cli_run import run

SCHED = "gpupool"


def node(name: str, profile: str = "dgx-h100") -> dict[str, Any]:
    pub = node_publication_for_profile(profile, node_name=name)
    resources = {**pub.host_capacity, **pub.capacity}
    return {"metadata": {"name": name, "labels": dict(pub.labels), "annotations": dict(pub.annotations),
                         "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {}, "status": {"capacity": resources, "allocatable": resources}}


def pod(name: str, *, gpus: int = 0, units: int = 0, priority: int = 0, created: int = 0, on: str | None = None,
        scheduler: str = SCHED, phase: str | None = None) -> dict[str, Any]:
    limits = {**({"nvidia.com/gpu": str(gpus)} if gpus else {}),
              **({"nvidia.com/gpu-memory": str(units)} if units else {})}
    spec: dict[str, Any] = {"schedulerName": scheduler, "priority": priority, "containers": [
        {"name": "main", "resources": {"limits": limits, "requests": {"cpu": "100m", **limits}}}]}
    if on:
        spec["nodeName"] = on
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": "5",
                         "creationTimestamp": f"2026-01-01T00:{created:02d}:00Z", "labels": {}, "annotations": {}},
            "spec": spec, "status": {"phase": phase or ("Running" if on else "Pending")}}


def offline_api(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> DryRunApi:
    unreachable = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
    return DryRunApi(unreachable, offline={"/api/v1/nodes": nodes, "/api/v1/pods": pods})


def what_if(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], policy: str = "best-fit",
            continuation: list[dict[str, Any]] | None = None) -> tuple[Outcome, DryRunApi]:
    api = offline_api(nodes, pods)
    try:
        outcome = asyncio.run(run_what_if(api, SchedulerConfig(policy=policy), continuation or []))
    finally:
        api.close()
    return outcome, api


def test_pending_pods_are_decided_in_the_queue_order_and_fill_what_running_pods_left() -> None:
    # one node of 8 GPUs; another scheduler's pod runs on 5 of them: 3 are left
    pods = [pod("other", gpus=5, on="n0", scheduler="default-scheduler"),
            pod("late-high", gpus=2, priority=10, created=3),
            pod("early-low", gpus=2, priority=0, created=1),
            pod("early-high", gpus=1, priority=10, created=2)]
    outcome, api = what_if([node("n0")], pods)
    # priority first, then the older pod: the low-priority pod finds 0 GPUs left and waits
    assert outcome.order == ["team/early-high", "team/late-high"]
    low = outcome.decisions["team/early-low"]
    assert low.node is None and low.reason == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    used = {g for key in outcome.order for g in outcome.decisions[key].devices["main"]["nvidia.com/gpu"]}
    assert len(used) == 3
    assert summary(outcome)["pending_placed"] == 2 and summary(outcome)["still_pending"] == 1
    assert summary(outcome)["allocated_percent"] == 100.0  # 5 + 3 of 8
    # nothing went out: every write was only recorded (Bindings among them)
    assert any(w.path.endswith("/bindings") for w in api.writes)


def test_a_high_priority_pod_preempts_and_is_placed_where_its_victims_were() -> None:
    pods = [pod("low-a", gpus=4, on="n0", priority=0, created=0),
            pod("low-b", gpus=4, on="n0", priority=0, created=0),
            pod("crit", gpus=8, priority=100, created=5)]
    # the running pods are ours, bound by an earlier decision: let a first what-if place them
    first, _ = what_if([node("n0")], [{**p, "spec": {k: v for k, v in p["spec"].items() if k != "nodeName"},
                                       "status": {"phase": "Pending"}} for p in pods[:2]])
    assert sorted(first.order) == ["team/low-a", "team/low-b"]
    outcome, _ = what_if([node("n0")], [pods[2], *(
        {**p, "metadata": {**p["metadata"], "annotations": {"gpupool.io/assignment": first.decisions[
            f"team/{p['metadata']['name']}"].assignment or ""}}} for p in pods[:2])])
    crit = outcome.decisions["team/crit"]
    assert sorted(crit.victims) == ["team/low-a", "team/low-b"] and crit.nominated == "n0"
    assert crit.node == "n0" and len(crit.devices["main"]["nvidia.com/gpu"]) == 8  # type: ignore[index]
    assert summary(outcome)["preemptions"] == 2 and summary(outcome)["moves"] == 0


def test_same_listing_same_answer() -> None:
    pods = [pod(f"p{i}", units=7 + 3 * i, created=i) for i in range(6)] + [pod("w", gpus=3, created=9)]
    one, _ = what_if([node("n0"), node("n1")], pods, policy="gpupool")
    two, _ = what_if([node("n0"), node("n1")], pods, policy="gpupool")
    assert [(k, d.node, d.assignment) for k, d in one.decisions.items()] == \
        [(k, d.node, d.assignment) for k, d in two.decisions.items()]
    assert len(one.order) == 7


def test_the_continuation_arrives_after_the_pending_pods_and_is_reported_apart() -> None:
    running = [pod("r0", gpus=2, created=0), pod("r1", units=10, created=1)]
    synthetic = draw(recent_mix(running, SCHED), 4, seed=7)
    outcome, _ = what_if([node("n0")], [pod("p", gpus=1, created=5)], continuation=synthetic)
    assert outcome.order[0] == "team/p"
    assert outcome.synthetic == [f"team/{s['metadata']['name']}" for s in synthetic]
    assert all(outcome.decisions[k].synthetic for k in outcome.synthetic)
    s = summary(outcome)
    assert (s["pending"], s["pending_placed"], s["continuation"], s["continuation_placed"]) == (1, 1, 4, 4)


def test_continuation_is_seeded_and_copies_what_decides_placement_only() -> None:
    listed = [pod("a", gpus=1, created=1), pod("b", units=20, created=2, on="n0"), pod("c", gpus=4, created=3),
              pod("old", gpus=8, created=0), pod("done", gpus=2, created=4, phase="Succeeded"),
              pod("theirs", gpus=2, created=5, scheduler="default-scheduler")]
    listed[1]["metadata"]["annotations"]["gpupool.io/assignment"] = "{}"
    listed[1]["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "g"
    mix = recent_mix(listed, SCHED, window=3)
    assert [m["metadata"]["name"] for m in mix] == ["a", "b", "c"]  # newest 3 of ours, not ended
    one, two, other = draw(mix, 30, seed=1), draw(mix, 30, seed=1), draw(mix, 30, seed=2)
    assert one == two and one != other
    assert {p["metadata"]["name"].split("-", 2)[2] for p in one} == {"a", "b", "c"}
    copy_of_b = next(p for p in one if p["metadata"]["name"].endswith("-b"))
    assert "nodeName" not in copy_of_b["spec"] and copy_of_b["status"] == {"phase": "Pending"}
    assert copy_of_b["metadata"]["annotations"] == {} and copy_of_b["metadata"]["labels"] == {}
    assert copy_of_b["spec"]["containers"] == listed[1]["spec"]["containers"]
    assert len({p["metadata"]["uid"] for p in one}) == 30
    assert draw(mix, 0, seed=1) == [] and draw([], 5, seed=1) == []


def test_report_counts_placed_pending_victims_and_moves() -> None:
    decisions = {
        "t/a": Decision("t/a", False, node="n0", victims=["t/v1", "t/v2"]),
        "t/b": Decision("t/b", False, reason="no room"),
        "t/c": Decision("t/c", True, node="n1", moves=["t/m"]),
        "t/d": Decision("t/d", True),
        "t/e": Decision("t/e", False, node="n1", evicted_by="t/a"),
    }
    outcome = Outcome("fgd", decisions, ["t/a", "t/c", "t/e"], ["t/a", "t/b", "t/e"], ["t/c", "t/d"],
                      total_gpus=16, allocated_milli=12_000, fragmented_milli=1_500.0, unsettled=[])
    s = summary(outcome)
    assert (s["pending_placed"], s["continuation_placed"], s["evicted_after_placing"], s["still_pending"]) == \
        (1, 1, 1, 2)
    assert (s["preemptions"], s["moves"], s["allocated_percent"], s["fragmented_gpus"]) == (2, 1, 75.0, 1.5)
    payload = report_json([outcome], server="https://x", scheduler_name=SCHED, seed=3, continuation=2)
    [policy] = payload["policies"]
    assert policy["decisions"][0] == {"pod": "t/a", "synthetic": False, "node": "n0", "victims": ["t/v1", "t/v2"]}
    assert policy["decisions"][1] == {"pod": "t/b", "synthetic": False, "reason": "no room"}


# ---- bad input -------------------------------------------------------------------------------------
def one_line(argv: list[str]) -> str:
    code, _, err = run(["simulate", "--from-cluster", *argv])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Any) -> None:
    assert "unknown policy 'nope'" in one_line(["--policy", "nope"])
    assert "--continue must be 0 or more" in one_line(["--continue", "-1"])
    assert "drop --nodes" in one_line(["--nodes", "x.csv", "--pods", "y.csv"])
    garbage = tmp_path / "kubeconfig"
    garbage.write_text("{not: a kubeconfig")
    assert str(garbage) in one_line(["--kubeconfig", str(garbage), "--policy", "best-fit"])
    closed = tmp_path / "closed.kubeconfig"
    closed.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: {server: "
                      "'http://127.0.0.1:9'}}]\nusers: [{name: u, user: {token: t}}]\n"
                      "contexts: [{name: c, context: {cluster: c, user: u}}]\n")
    line = one_line(["--kubeconfig", str(closed), "--policy", "best-fit"])
    assert "cannot reach the API server at http://127.0.0.1:9" in line


def test_the_current_policy_is_the_chart_configmaps_one() -> None:
    def cm(namespace: str, policy: str | None) -> dict[str, Any]:
        return {"metadata": {"namespace": namespace, "name": "gpupool-scheduler-policy"},
                "data": {} if policy is None else {"policy": policy}}

    assert policy_of([cm("a", "fgd"), cm("b", "fgd"), cm("c", None)]) == "fgd"
    with pytest.raises(UserError, match="no scheduler ConfigMap with a 'policy' key"):
        policy_of([cm("c", None)])
    with pytest.raises(UserError, match="disagree: a/gpupool-scheduler-policy says 'fgd', b/"):
        policy_of([cm("a", "fgd"), cm("b", "best-fit")])
    with pytest.raises(UserError, match="names an unknown policy 'nope'"):
        policy_of([cm("a", "nope")])


def test_a_podgroup_is_placed_whole_or_not_at_all() -> None:
    from gpupool_sched.framework.plugins.gangs import PODGROUPS

    group = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
             "metadata": {"name": "g", "namespace": "team", "uid": "uid-g", "resourceVersion": "1"},
             "spec": {"minMember": 2}}
    members = [pod(f"m{i}", gpus=8, created=i) for i in range(2)]
    for m in members:
        m["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "g"
    listings = {PODGROUPS: [group], "/api/v1/pods": members}
    for nodes, placed in (([node("n0")], 0), ([node("n0"), node("n1")], 2)):
        api = DryRunApi(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")),
                        offline={**listings, "/api/v1/nodes": nodes})
        outcome = asyncio.run(run_what_if(api, SchedulerConfig(policy="best-fit")))
        api.close()
        assert summary(outcome)["pending_placed"] == placed, outcome.decisions
        if placed:
            assert {d.node for d in outcome.decisions.values()} == {"n0", "n1"}
        else:
            assert all("PodGroup team/g" in (d.reason or "") for d in outcome.decisions.values()), outcome.decisions


def test_a_gpuquota_keeps_a_team_within_its_guarantee() -> None:
    from gpupool_sched.framework.plugins.quotas import NAMESPACES_PATH, QUOTAS_PATH

    namespace = {"metadata": {"name": "team", "labels": {"team": "a"}, "resourceVersion": "1"}}
    quota = {"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuQuota",
             "metadata": {"name": "a", "uid": "uid-quota-a", "generation": 1, "resourceVersion": "1"},
             "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}},
                      "guaranteed": {"gpus": 3, "memoryUnits": 0}, "borrowingLimit": {"gpus": 0, "memoryUnits": 0}}}
    pods = [pod(f"p{i}", gpus=2, created=i) for i in range(3)]
    api = DryRunApi(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")),
                    offline={NAMESPACES_PATH: [namespace], QUOTAS_PATH: [quota], "/api/v1/nodes": [node("n0")],
                             "/api/v1/pods": pods})
    outcome = asyncio.run(run_what_if(api, SchedulerConfig(policy="best-fit")))
    api.close()
    # 8 GPUs free, but the team may hold 3: one 2-GPU pod, the others wait for the quota
    assert outcome.order == ["team/p0"], outcome.decisions
    assert all("GpuQuota a" in (outcome.decisions[f"team/p{i}"].reason or "") for i in (1, 2)), outcome.decisions


def test_a_candidate_configuration_is_the_schedulers_flags() -> None:
    config = candidate_config("--policy fgd --defrag off --percentage-of-nodes-to-score 50 --leader-elect", "mine")
    assert (config.policy, config.defrag.enabled, config.percentage_of_nodes_to_score) == ("fgd", False, 50)
    assert (config.scheduler_name, config.leader_elect) == ("mine", False)  # the what-if's name; decides alone
    assert candidate_config("", "mine").policy == "gpupool"  # the scheduler's defaults
    line = one_line(["--candidate", "--policy nope"])
    assert line.startswith("gpupool simulate: error: --candidate '--policy nope': argument --policy: invalid choice")
    assert one_line(["--candidate", "--policy 'fgd"]).endswith("--candidate \"--policy 'fgd\": No closing quotation")
    assert "need --retry-period < --renew-deadline" in one_line(["--candidate", "--retry-period 20"])
