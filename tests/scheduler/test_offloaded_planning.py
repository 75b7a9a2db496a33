"""Eviction planning leaves the scheduler's loop: while a preemption plan is computed (on a worker thread,
against its own snapshot copy) the watch is served, and a plan whose victims changed meanwhile is not
carried out: the pod is tried again and plans on what is there now."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from gpupool_sched.framework.actions import evictions
from tests.support.decision_record import World


class Gate:
    """Holds plan_preemption on its worker thread until released; says when it is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []
        real = evictions.plan_preemption

        def held(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(10), "the test never released the plan"
            return real(*args, **kwargs)

        monkeypatch.setattr(evictions, "plan_preemption", held)


async def filled_world() -> World:
    """n1 (4 GPUs) full of priority-100 pods of another scheduler; `urgent` (4 GPUs, priority 1000) pending."""
    world = World("best-fit")
    world.service.recorder.start()
    steps: list[dict[str, Any]] = [
        {"op": "priority_class", "name": "low", "value": 100},
        {"op": "node", "name": "n1", "profile": "l40s-pcie"},
        *({"op": "running", "name": f"low-{i}", "scheduler": "default-scheduler", "gpus": 1, "node": "n1",
           "priority": 100} for i in range(4)),
        {"op": "pod", "name": "urgent", "gpus": 4, "priority": 1000},
    ]
    for i, step in enumerate(steps):
        await world.step(i, step)
    return world


async def wait_for(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the plan never started")


def evictions_written(world: World) -> list[str]:
    return sorted(path for method, path, _ in world.api.writes if method == "POST" and path.endswith("/eviction"))


def test_the_watch_is_served_while_a_plan_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)

    async def go() -> None:
        world = await filled_world()
        service = world.service
        item = service.queue.pop()
        assert item is not None and item.key == "default/urgent"
        deciding = asyncio.create_task(service.scheduling.schedule_one_offloaded(item))
        await wait_for(gate.entered)
        assert gate.threads and gate.threads[0] != threading.current_thread().name  # off the loop
        # a watch event while the plan is computed: handled now, not after the plan
        await world.step(90, {"op": "pod", "name": "newcomer", "gpus": 1, "priority": 0})
        assert service.queue.where("uid-default-newcomer") is not None
        assert not deciding.done()
        gate.release.set()
        await deciding
        await world.settle(None)
        assert len(evictions_written(world)) == 4  # the plan held: n1's four pods are evicted for urgent
        await world.service.recorder.stop()
        world.api.close()

    asyncio.run(go())


def test_a_plan_whose_victim_went_meanwhile_is_not_carried_out(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)

    async def go() -> None:
        world = await filled_world()
        service = world.service
        item = service.queue.pop()
        assert item is not None
        deciding = asyncio.create_task(service.scheduling.schedule_one_offloaded(item))
        await wait_for(gate.entered)
        await world.step(90, {"op": "delete", "pods": ["low-0"]})  # a victim of the plan goes meanwhile
        gate.release.set()
        await deciding
        await world.settle(None)
        assert evictions_written(world) == []  # stale: nothing evicted on a view that no longer holds
        assert "uid-default-urgent" not in service.state.nominations
        # tried again (backoff), it plans on what is there now: the three pods left
        world.clock.now += 10
        again = service.queue.pop()
        assert again is not None and again.key == "default/urgent"
        gate.entered.clear()
        await service.scheduling.schedule_one_offloaded(again)
        await world.settle(None)
        assert [p.rsplit("/", 2)[-2] for p in evictions_written(world)] == ["low-1", "low-2", "low-3"]
        await world.service.recorder.stop()
        world.api.close()

    asyncio.run(go())
