"""The time simulator decides as the scheduler service does: one scenario (arrivals, departures, a preemption
and its requeue) driven once through the service's code path (nodes and pods as API objects through
`ClusterState.apply_node/apply_pod`, a `Cycle` with `running_pods` candidates, bindings confirmed by the
watch, departures and evictions as watch deletions) and once through `Timeline`; the same placements,
GPUs and victims, at the same times."""

from __future__ import annotations

from typing import Any

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.cycle import Cycle
from gpupool_sched.framework.plugins.victims import DisruptionBudgets, running_pods
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.simulate.lifetimes import TimedPod
from gpupool_sched.simulate.timeline import Decision, Timeline
from tests.support.objects import bump, node_obj, pod_obj

# name, arrival, GPUs, priority, lifetime: two 4-GPU nodes
SCENARIO = [
    ("a", 0.0, 2, 0, 500.0),
    ("b", 1.0, 1, 0, 300.0),
    ("c", 2.0, 4, 0, 1000.0),
    ("d", 3.0, 1, 100, 900.0),
    ("h", 100.0, 4, 2000, 50.0),  # fits nowhere: preempts
    ("e", 400.0, 1, 0, 100.0),
]


def pod(name: str, gpus: int, priority: int) -> dict[str, Any]:
    obj = pod_obj(name, gpus=gpus)
    obj["spec"]["priority"] = priority
    return obj


class Service:
    """The service's path, step by step, with a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.state = ClusterState("gpupool", clock=lambda: self.now)
        for name in ("n1", "n2"):
            self.state.apply_node(node_obj(name))
        self.cycle = Cycle(self.state, lambda: build_policy("best-fit"))
        self.budgets = DisruptionBudgets()
        self.objs: dict[str, dict[str, Any]] = {}
        self.log: list[Decision] = []

    def schedule(self, name: str) -> bool:
        obj = self.objs[name]
        plan = self.state.plan(obj)
        floor = plan.priority
        result = self.cycle.schedule(plan, lambda: running_pods(self.state, self.budgets, floor))
        if result.statement is not None and result.statement.placements:
            placement = result.statement.placements[0][1]
            self.log.append(Decision(self.now, name, placement.node, placement.gpu_indices))
            self.objs[name] = bump(obj, node=placement.node, phase="Running")
            self.state.apply_pod(self.objs[name])  # the watch confirms the binding
            return True
        if result.preemption is not None:
            names = {o["metadata"]["uid"]: n for n, o in self.objs.items()}
            victims = [names[v.uid] for v in result.preemption.victims]
            self.log.append(Decision(self.now, name, result.preemption.node, (), tuple(sorted(victims))))
            for victim in victims:
                self.delete(victim)
            return self.schedule(name)
        return False

    def arrive(self, name: str, gpus: int, priority: int) -> bool:
        self.objs[name] = pod(name, gpus, priority)
        return self.schedule(name)

    def delete(self, name: str) -> None:
        self.state.apply_pod(bump(self.objs.pop(name)), deleted=True)


def test_the_timeline_decides_as_the_service() -> None:
    service = Service()
    requests = {}
    for name, at, gpus, priority, _ in SCENARIO[:4]:
        service.now = at
        assert service.arrive(name, gpus, priority)
    service.now = 100.0
    assert service.arrive("h", 4, 2000)  # evicts c, placed at once
    # c is recreated by its controller: a new pod, which waits
    assert not service.arrive("c", 4, 0)
    service.now = 150.0
    service.delete("h")
    assert service.schedule("c")  # the room h leaves takes the waiting c
    service.now = 301.0
    service.delete("b")
    service.now = 400.0
    assert service.arrive("e", 1, 0)

    for name, _, gpus, priority, _ in SCENARIO:
        requests[name] = service.state.plan(pod(name, gpus, priority)).request
    views = [service.state.nodes[n] for n in ("n1", "n2")]
    policy = build_policy("best-fit")
    timeline = Timeline(views, lambda: policy, record=True)
    arrivals = [(at, TimedPod(requests[name], life, 1e6, f"p{priority}")) for name, at, _, priority, life in SCENARIO]
    timeline.run(iter(arrivals), 420.0)

    assert timeline.decisions == service.log
    assert [d for d in service.log if d.victims] == [Decision(100.0, "h", "n2", (), ("c",))]
