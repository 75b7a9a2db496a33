"""SchedulingQueue: ordering, backoff, unschedulable pods and their hints, flush, in-flight updates."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpupool_sched.framework.queue import ClusterEvent, QueuedPod, SchedulingQueue

NODE_ADDED, NODE_CHANGED, GPU_FREED = ClusterEvent.NODE_ADDED, ClusterEvent.NODE_CHANGED, ClusterEvent.GPU_FREED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def qp(uid: str, priority: int = 0, created: float = 0.0, payload: object = None, revision: object = None) -> QueuedPod:
    return QueuedPod(uid=uid, key=f"ns/{uid}", priority=priority, created=created, payload=payload, revision=revision)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def q(clock: Clock) -> SchedulingQueue:
    return SchedulingQueue(initial_backoff_s=1.0, max_backoff_s=10.0, unschedulable_flush_s=60.0, clock=clock)


def drain(q: SchedulingQueue) -> list[str]:
    out = []
    while (pod := q.pop()) is not None:
        out.append(pod.uid)
        q.done(pod.uid)
    return out


# ---- ordering ------------------------------------------------------------------------------------


def test_pop_order_priority_then_creation_then_uid(q):
    for pod in (qp("c", 0, 5.0), qp("a", 0, 5.0), qp("low", -1, 0.0), qp("old", 0, 1.0), qp("hi", 10, 9.0)):
        q.add(pod)
    assert drain(q) == ["hi", "old", "a", "c", "low"]
    assert q.pop() is None


def test_pop_counts_attempts_and_tracks_the_pod_in_flight(q):
    q.add(qp("a"))
    pod = q.pop()
    assert pod.attempts == 1 and "a" in q and len(q) == 0 and q.in_flight == 1 and q.where("a") == "in-flight"
    q.backoff(pod)
    assert q.where("a") == "backoff" and q.in_flight == 0 and len(q) == 1


def test_first_seen_is_kept_across_updates(q, clock):
    q.add(qp("a"))
    clock.advance(5)
    q.add(qp("a", payload="v2"))
    pod = q.pop()
    assert pod.first_seen == 1000.0 and pod.payload == "v2"


def test_update_of_an_active_pod_reorders_it(q):
    q.add(qp("a", 0, 1.0))
    q.add(qp("b", 0, 2.0))
    q.add(qp("b", 5, 2.0, payload="urgent"))
    pod = q.pop()
    assert (pod.uid, pod.payload) == ("b", "urgent")
    assert drain(q) == ["a"]
    assert q.lengths_by_priority() == {}


# ---- backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_per_attempt_up_to_the_cap(q):
    assert [q.backoff_s(n) for n in range(0, 8)] == [1, 1, 2, 4, 8, 10, 10, 10]
    assert q.backoff_s(10**6) == 10


def test_backed_off_pod_comes_back_when_its_backoff_expires(q, clock):
    q.add(qp("a"))
    for attempt, wait in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (6, 10.0)):
        pod = q.pop()
        assert pod.attempts == attempt
        q.backoff(pod)
        clock.advance(wait - 0.01)
        assert q.pop() is None and q.pending_counts() == {"active": 0, "backoff": 1, "unschedulable": 0}
        clock.advance(0.01)
    assert q.pop().attempts == 7


def test_zero_backoff_goes_straight_to_active(clock):
    q = SchedulingQueue(initial_backoff_s=0.0, max_backoff_s=0.0, clock=clock)
    q.add(qp("a"))
    q.backoff(q.pop())
    assert q.pending_counts()["active"] == 1


def test_flush_moves_expired_backoffs(q, clock):
    q.add(qp("a"))
    q.backoff(q.pop())
    clock.advance(1.0)
    assert q.flush() == 1
    assert q.pending_counts() == {"active": 1, "backoff": 0, "unschedulable": 0}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        SchedulingQueue(initial_backoff_s=5, max_backoff_s=1)


# ---- unschedulable pods --------------------------------------------------------------------------


def test_parked_pod_waits_for_a_hinted_event(q, clock):
    q.add(qp("a"))
    q.park(q.pop(), {NODE_ADDED, GPU_FREED})
    assert q.where("a") == "unschedulable"
    assert q.on_event(NODE_CHANGED) == 0 and q.pop() is None
    clock.advance(5)  # past its 1 s backoff
    assert q.on_event(GPU_FREED) == 1
    assert q.where("a") == "active" and q.pop().uid == "a"


def test_event_during_backoff_sends_to_backoff(q, clock):
    q.add(qp("a"))
    q.park(q.pop(), {GPU_FREED})
    clock.advance(0.5)
    assert q.on_event(GPU_FREED) == 1
    assert q.where("a") == "backoff" and q.pop() is None
    clock.advance(0.5)
    assert q.pop().uid == "a"


def test_event_moves_only_once_and_clears_other_hints(q, clock):
    q.add(qp("a"))
    q.add(qp("b"))
    q.park(q.pop(), {NODE_ADDED, GPU_FREED})
    q.park(q.pop(), {GPU_FREED})
    clock.advance(2)
    assert q.on_event(GPU_FREED) == 2
    assert q.on_event(NODE_ADDED) == 0
    assert sorted(drain(q)) == ["a", "b"]


def test_parked_without_hints_waits_for_an_update(q, clock):
    q.add(qp("a", payload=1))
    q.park(q.pop(), ())
    for event in ClusterEvent:
        assert q.on_event(event) == 0
    clock.advance(3)
    q.add(qp("a", payload=2))
    assert q.where("a") == "active" and q.pop().payload == 2


def test_update_with_the_same_revision_is_not_a_change(q, clock):
    q.add(qp("a", payload=1, revision="r1"))
    q.park(q.pop(), ())
    q.add(qp("a", payload=2, revision="r1"))  # e.g. our own Unschedulable condition on the pod
    assert q.where("a") == "unschedulable"
    q.add(qp("a", payload=3, revision="r2"))
    assert q.where("a") == "backoff"  # changed within its backoff
    clock.advance(1)
    assert q.pop().payload == 3


def test_flush_is_the_safety_net_for_parked_pods(q, clock):
    q.add(qp("old"))
    q.park(q.pop(), {NODE_ADDED})
    clock.advance(30)
    q.add(qp("new"))
    q.park(q.pop(), {NODE_ADDED})
    q.add(qp("pinned"))
    q.park(q.pop(), (), flush=False)
    clock.advance(30)
    assert q.flush() == 1 and q.where("old") == "active" and q.where("new") == "unschedulable"
    clock.advance(30)
    assert q.flush() == 1 and q.where("new") == "active"
    clock.advance(3600)
    assert q.flush() == 0 and q.where("pinned") == "unschedulable"


def test_repark_moves_a_pod_to_the_end_of_the_flush_order(q, clock):
    q.add(qp("a"))
    q.add(qp("b"))
    q.park(q.pop(), ())
    q.park(q.pop(), ())
    clock.advance(50)
    q.add(qp("a", payload="changed"))
    clock.advance(1)
    q.park(q.pop(), ())
    clock.advance(10)  # b parked 61 s ago, a 10 s ago
    assert q.flush() == 1 and q.where("b") == "active" and q.where("a") == "unschedulable"


# ---- in flight -----------------------------------------------------------------------------------


def test_hinted_event_while_in_flight_sends_park_to_backoff(q, clock):
    q.add(qp("a"))
    pod = q.pop()
    q.on_event(GPU_FREED)  # happened while the cycle was deciding
    q.park(pod, {GPU_FREED})
    assert q.where("a") == "backoff"


def test_unrelated_event_while_in_flight_parks(q):
    q.add(qp("a"))
    pod = q.pop()
    q.on_event(NODE_CHANGED)
    q.park(pod, {GPU_FREED})
    assert q.where("a") == "unschedulable"


def test_events_before_the_pop_do_not_count(q):
    q.add(qp("a"))
    q.on_event(GPU_FREED)
    q.park(q.pop(), {GPU_FREED})
    assert q.where("a") == "unschedulable"


def test_update_while_in_flight_is_kept(q, clock):
    q.add(qp("a", payload="v1", revision=1))
    pod = q.pop()
    q.add(qp("a", payload="v2", revision=2))
    assert q.where("a") == "in-flight" and q.pop() is None
    q.park(pod, {NODE_ADDED})
    assert q.where("a") == "backoff"
    clock.advance(1)
    again = q.pop()
    assert (again.payload, again.attempts) == ("v2", 2)


def test_unchanged_update_while_in_flight_parks(q):
    q.add(qp("a", payload="v1", revision=1))
    pod = q.pop()
    q.add(qp("a", payload="v1+status", revision=1))
    q.park(pod, {NODE_ADDED})
    assert q.where("a") == "unschedulable"


def test_backoff_after_an_update_in_flight_uses_the_new_payload(q, clock):
    q.add(qp("a", payload="v1"))
    pod = q.pop()
    q.add(qp("a", payload="v2"))
    q.backoff(pod)
    clock.advance(1)
    assert q.pop().payload == "v2"


def test_delete_in_flight_drops_the_pod_for_good(q, clock):
    q.add(qp("a"))
    pod = q.pop()
    q.delete("a")
    assert "a" not in q
    q.park(pod, {GPU_FREED})
    q.backoff(pod)
    clock.advance(100)
    q.on_event(GPU_FREED)
    q.flush()
    assert q.pop() is None and "a" not in q and len(q) == 0


@pytest.mark.parametrize("where", ["active", "backoff", "unschedulable"])
def test_take_puts_a_waiting_pod_in_flight_from_any_set(q, clock, where):
    """A gang's other members are taken with the popped one, from wherever they wait."""
    q.add(qp("m"))
    if where != "active":
        pod = q.pop()
        q.backoff(pod) if where == "backoff" else q.park(pod, {GPU_FREED})
    taken = q.take("m")
    assert taken is not None and taken.uid == "m" and q.where("m") == "in-flight" and len(q) == 0
    assert q.take("m") is None and q.take("unknown") is None
    assert q.pop() is None  # the stale heap entry is skipped
    assert sum(q.pending_counts().values()) == 0 and q.in_flight == 1
    q.park(taken, {GPU_FREED})
    assert q.where("m") == "unschedulable" and q.on_event(GPU_FREED) == 1


def test_done_forgets_the_pod(q):
    q.add(qp("a"))
    q.pop()
    q.done("a")
    assert "a" not in q and q.in_flight == 0


def test_park_of_a_pod_not_in_flight_is_ignored(q):
    q.park(qp("ghost"), {GPU_FREED})
    q.backoff(qp("ghost"))
    assert "ghost" not in q


# ---- delete and views ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["active", "backoff", "unschedulable"])
def test_delete_from_every_set(q, clock, where):
    q.add(qp("a", priority=3))
    q.add(qp("b"))
    if where != "active":
        pod = q.pop()
        q.park(pod, {GPU_FREED}) if where == "unschedulable" else q.backoff(pod)
    assert q.where("a") == where
    q.delete("a")
    assert "a" not in q and q.where("a") is None
    clock.advance(100)
    assert q.on_event(GPU_FREED) == 0
    q.flush()
    assert drain(q) == ["b"]


def test_counts_and_lengths(q, clock):
    for uid, prio in (("a", 1), ("b", 1), ("c", 2), ("d", 0)):
        q.add(qp(uid, prio))
    q.park(q.pop(), {GPU_FREED})  # c
    q.backoff(q.pop())  # a
    assert q.pending_counts() == {"active": 2, "backoff": 1, "unschedulable": 1}
    assert q.lengths_by_priority() == {0: 1, 1: 2, 2: 1}
    assert q.lengths() == {("active", 0): 1, ("active", 1): 1, ("backoff", 1): 1, ("unschedulable", 2): 1}
    assert len(q) == 4
    q.pop()  # b in flight
    assert len(q) == 3 and "b" in q and q.lengths_by_priority() == {0: 1, 1: 1, 2: 1}


def test_priority_change_while_backing_off_is_counted(q, clock):
    q.add(qp("a", 1))
    q.backoff(q.pop())
    q.add(qp("a", 7))
    assert q.lengths() == {("backoff", 7): 1}
    clock.advance(1)
    assert q.pop().priority == 7


# ---- wait ----------------------------------------------------------------------------------------


def test_wait_returns_at_once_when_a_pod_is_active():
    async def main() -> float:
        q = SchedulingQueue()
        q.add(qp("a"))
        start = time.monotonic()
        await q.wait(5.0)
        return time.monotonic() - start

    assert asyncio.run(main()) < 0.5


def test_wait_wakes_on_add_and_times_out():
    async def main() -> tuple[float, float]:
        q = SchedulingQueue()
        start = time.monotonic()
        await q.wait(0.05)
        timed_out = time.monotonic() - start
        asyncio.get_running_loop().call_later(0.05, q.add, qp("a"))
        start = time.monotonic()
        await q.wait(5.0)
        return timed_out, time.monotonic() - start

    timed_out, woke = asyncio.run(main())
    assert 0.04 <= timed_out < 1.0 and woke < 1.0


def test_wait_ends_when_the_earliest_backoff_expires():
    async def main() -> tuple[float, str | None]:
        q = SchedulingQueue(initial_backoff_s=0.1, max_backoff_s=1.0)
        q.add(qp("a"))
        q.backoff(q.pop())
        start = time.monotonic()
        await q.wait(5.0)
        pod = q.pop()
        return time.monotonic() - start, pod.uid if pod else None

    waited, uid = asyncio.run(main())
    assert 0.05 <= waited < 1.0 and uid == "a"


def test_wait_wakes_when_an_event_activates_a_parked_pod():
    async def main() -> float:
        q = SchedulingQueue(initial_backoff_s=0.0, max_backoff_s=0.0)
        q.add(qp("a"))
        q.park(q.pop(), {NODE_ADDED})
        asyncio.get_running_loop().call_later(0.05, q.on_event, NODE_ADDED)
        start = time.monotonic()
        await q.wait(5.0)
        return time.monotonic() - start

    assert asyncio.run(main()) < 1.0


# ---- scale ---------------------------------------------------------------------------------------


def test_twenty_thousand_pods_with_churn(clock):
    q = SchedulingQueue(clock=clock)
    rng = random.Random(7)
    pods = [qp(f"p{k:05d}", rng.randint(0, 5), rng.random() * 1000) for k in range(20_000)]
    start = time.perf_counter()
    for pod in pods:
        q.add(pod)
    for _ in range(3):  # updates that reorder every pod
        for pod in pods:
            q.add(qp(pod.uid, pod.priority, pod.created + 0.5))
    for pod in pods[::2]:
        q.delete(pod.uid)
    order = drain(q)
    elapsed = time.perf_counter() - start
    expected = sorted(pods[1::2], key=lambda p: (-p.priority, p.created, p.uid))
    assert order == [p.uid for p in expected]
    assert elapsed < 10.0, elapsed
    assert len(q._active) <= 2 * 10_000 + 1024  # lazily deleted items were compacted


def test_mass_event_moves_thousands_of_parked_pods(clock):
    q = SchedulingQueue(clock=clock)
    for k in range(10_000):
        q.add(qp(f"p{k}"))
    while (pod := q.pop()) is not None:
        q.park(pod, {GPU_FREED} if int(pod.uid[1:]) % 2 else {NODE_ADDED})
    clock.advance(2)
    assert q.on_event(GPU_FREED) == 5_000
    assert q.pending_counts() == {"active": 5_000, "backoff": 0, "unschedulable": 5_000}


# ---- random operations: the queue's invariants ---------------------------------------------------


class QueueMachine(RuleBasedStateMachine):
    """Random operations; afterwards every known pod comes out exactly once, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.q = SchedulingQueue(clock=self.clock)
        self.flying: dict[str, QueuedPod] = {}
        self.known: dict[str, int] = {}  # uid -> priority, pods that are waiting or in flight

    @rule(uid=st.sampled_from([f"u{k}" for k in range(8)]), priority=st.integers(0, 3), revision=st.integers(0, 2))
    def add(self, uid: str, priority: int, revision: int) -> None:
        self.q.add(qp(uid, priority, revision=revision))
        self.known[uid] = priority

    @rule()
    def pop(self) -> None:
        pod = self.q.pop()
        if pod is not None:
            assert pod.uid in self.known and pod.uid not in self.flying
            self.flying[pod.uid] = pod

    @rule(data=st.data(), how=st.sampled_from(["park", "backoff", "done"]),
          hints=st.sets(st.sampled_from(list(ClusterEvent))))
    def hand_back(self, data: st.DataObject, how: str, hints: set[ClusterEvent]) -> None:
        if not self.flying:
            return
        uid = data.draw(st.sampled_from(sorted(self.flying)))
        pod = self.flying.pop(uid)
        if how == "park":
            self.q.park(pod, hints)
        elif how == "backoff":
            self.q.backoff(pod)
        else:
            self.q.done(uid)
            del self.known[uid]

    @rule(uid=st.sampled_from([f"u{k}" for k in range(8)]))
    def take(self, uid: str) -> None:
        pod = self.q.take(uid)
        if pod is None:
            assert uid not in self.known or uid in self.flying
        else:
            assert uid in self.known and uid not in self.flying
            self.flying[uid] = pod

    @rule(uid=st.sampled_from([f"u{k}" for k in range(8)]))
    def delete(self, uid: str) -> None:
        self.q.delete(uid)
        self.known.pop(uid, None)
        self.flying.pop(uid, None)

    @rule(event=st.sampled_from(list(ClusterEvent)))
    def event(self, event: ClusterEvent) -> None:
        self.q.on_event(event)

    @rule(seconds=st.sampled_from([0.5, 1.0, 30.0, 61.0]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.q.flush()

    @invariant()
    def counts_agree(self) -> None:
        counts = self.q.pending_counts()
        assert sum(counts.values()) == len(self.q) == len(self.known) - len(self.flying)
        assert self.q.in_flight == len(self.flying)
        assert sum(self.q.lengths_by_priority().values()) == len(self.q)
        for uid in self.known:
            assert uid in self.q
            if uid in self.flying:
                assert self.q.where(uid) == "in-flight"
            else:
                assert self.q.where(uid) in ("active", "backoff", "unschedulable")

    def teardown(self) -> None:
        for uid in list(self.flying):
            self.q.backoff(self.flying.pop(uid))
        self.clock.advance(1000)
        self.q.flush()
        out = []
        while (pod := self.q.pop()) is not None:
            out.append(pod)
        assert sorted(p.uid for p in out) == sorted(self.known)
        assert [p.priority for p in out] == sorted((p.priority for p in out), reverse=True)
        assert all(p.priority == self.known[p.uid] for p in out)


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
