"""The ledger's index of accounted entries by priority (`Ledger.running(below)`), which preemption's
candidates come from: it follows every change of what is accounted, so no stale entry is offered as a
victim (a pod re-accounted at another priority, one being evicted, a victim turned into a hold) and none
is missed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpupool_sched.cache.entries import Phase
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, running_pods
from gpupool_sched.placement.registry import build_policy
from tests.support.objects import bump, node_obj, pod_obj


def prio_pod(name: str, priority: int, *, node: str | None = None, scheduler: str = "other") -> dict[str, Any]:
    obj = pod_obj(name, gpus=1, node=node, scheduler=scheduler, phase="Running" if node else "Pending")
    obj["spec"]["priority"] = priority
    obj["metadata"]["labels"] = {"app": node or "pending"}
    return obj


class World:
    """Two 4-GPU nodes full of 1-GPU pods of another scheduler: priority 100 on n1, 200 on n2."""

    def __init__(self) -> None:
        self.state = ClusterState("gpupool", clock=lambda: 0.0)
        self.state.apply_node(node_obj("n1"))
        self.state.apply_node(node_obj("n2"))
        self.budgets = DisruptionBudgets()
        self.pods: dict[str, dict[str, Any]] = {}
        for node, priority in (("n1", 100), ("n2", 200)):
            for i in range(4):
                obj = prio_pod(f"{node}-{i}", priority, node=node)
                self.pods[obj["metadata"]["uid"]] = obj
                self.state.apply_pod(obj)
        self.cycle = Cycle(self.state, lambda: build_policy("best-fit"))

    def uid(self, name: str) -> str:
        return next(u for u, o in self.pods.items() if o["metadata"]["name"] == name)

    def below(self, priority: int) -> set[str]:
        return {p.uid for p in running_pods(self.state, self.budgets, below=priority)}

    def by_scan(self, priority: int) -> set[str]:
        """The same candidates from a pass over the whole ledger (what the index spares)."""
        return {e.uid for e in self.state.running() if e.request.priority < priority}


def test_candidates_below_a_priority_are_the_running_pods_of_lower_priority() -> None:
    world = World()
    n1 = {world.uid(f"n1-{i}") for i in range(4)}
    assert world.below(150) == world.by_scan(150) == n1
    assert world.below(250) == world.by_scan(250) == set(world.pods)
    assert world.below(100) == set() and not world.state.has_lower_priority(100)
    assert world.state.has_lower_priority(101)


def test_a_pod_re_accounted_at_another_priority_leaves_its_old_priority() -> None:
    world = World()
    uid = world.uid("n1-0")
    entry = world.state.pods[uid]
    # what the ledger does when it re-accounts a pod (`_account_from`): release, change, account again
    world.state._unapply(entry)
    entry.request = replace(entry.request, priority=300)
    world.state._apply(entry)
    assert uid not in world.below(150) and uid not in world.below(300)
    assert uid in world.below(301)
    assert world.below(150) == world.by_scan(150) and world.below(301) == world.by_scan(301)


def test_a_node_update_re_accounts_its_pods_once() -> None:
    world = World()
    changed = node_obj("n1")
    changed["metadata"]["labels"]["zone"] = "b"  # a new spec: the node's row is reset, its pods re-accounted
    world.state.apply_node(changed)
    assert [p.uid for p in running_pods(world.state, world.budgets, below=150)].count(world.uid("n1-0")) == 1
    assert world.below(150) == world.by_scan(150) == {world.uid(f"n1-{i}") for i in range(4)}


def test_pods_being_evicted_and_victims_turned_into_holds_are_no_candidates() -> None:
    world = World()
    critical = world.state.plan(prio_pod("critical", 1000, scheduler="gpupool"))
    result = world.cycle.schedule(critical, lambda: running_pods(world.state, world.budgets, below=1000))
    assert result.preemption is not None
    victims = {v.uid for v in result.preemption.victims}
    assert victims and victims <= {world.uid(f"n1-{i}") for i in range(4)}
    assert not victims & world.below(1000)  # marked for eviction: not offered again
    for uid in victims:  # they go: what they held becomes holds for the preemptor (a new UID each)
        world.state.apply_pod(bump(world.pods[uid]), deleted=True)
    holds = [e for e in world.state.pods.values() if e.phase is Phase.NOMINATED]
    assert len(holds) == len(victims) and all(e.applied for e in holds)
    assert world.below(1000) == world.by_scan(1000) == set(world.pods) - victims
    world.state.end_nomination(critical.uid)  # the holds go: nothing of them is left behind in the index
    for uid in set(world.pods) - victims:
        world.state.apply_pod(bump(world.pods[uid]), deleted=True)
    assert not world.state.has_lower_priority(1000) and world.below(1000) == set()


def test_a_budget_that_changes_is_seen_by_the_candidates_below_a_priority() -> None:
    world = World()
    assert not any(p.pdb_blocked for p in running_pods(world.state, world.budgets, below=150))
    world.budgets.apply("ADDED", {"metadata": {"namespace": "ns", "name": "keep-n1"},
                                  "spec": {"selector": {"matchLabels": {"app": "n1"}}},
                                  "status": {"disruptionsAllowed": 0}})
    blocked = running_pods(world.state, world.budgets, below=150)
    assert len(blocked) == 4 and all(p.pdb_blocked for p in blocked)
