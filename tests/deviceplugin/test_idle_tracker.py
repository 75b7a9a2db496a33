"""The idleness definition on scripted timelines (pure: samples in, idle seconds and idle-or-not out)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpupool_deviceplugin.idle import IdlePolicy, IdleTracker, Sample

GIB = 1 << 30
DEFAULT = IdlePolicy()  # window 10 min, < 1 %, memory within 1 %, grace 5 min, gap 30 s


def run(policy: IdlePolicy, activity: Callable[[float], float | None], until_s: float, every_s: float = 10.0,
        memory: Callable[[float], int | None] = lambda t: 4 * GIB) -> tuple[IdleTracker, list[tuple[float, bool]]]:
    """Feed one key a sample every `every_s` seconds; `activity(t)` is the highest activity since the
    previous sample (what the sampler reads from NVML's buffer). Returns the tracker and (t, idle) per step."""
    tracker = IdleTracker(policy)
    seen = []
    t = 0.0
    while t <= until_s:
        tracker.observe("k", Sample(t, activity(t), memory(t)))
        state = tracker.state("k", t)
        assert state is not None
        seen.append((t, state.idle))
        t += every_s
    return tracker, seen


def test_an_idle_pod_becomes_idle_after_the_window_and_not_before() -> None:
    tracker, seen = run(DEFAULT, lambda t: 0.0, until_s=3600)
    first_idle = next(t for t, idle in seen if idle)
    assert first_idle == 600  # grace (300 s) is shorter than the window: the window decides
    assert all(idle for t, idle in seen if t >= 600)
    state = tracker.state("k", 3600)
    assert state is not None and state.idle_s == 3600


def test_a_busy_pod_is_never_idle() -> None:
    _, seen = run(DEFAULT, lambda t: 35.0, until_s=7200)
    assert not any(idle for _, idle in seen)


def test_a_bursty_pod_busy_2s_every_5min_is_never_idle_under_the_default_window() -> None:
    # busy for 2 s at the start of every 5 min; a sample covers the 10 s before it, so the one at t holds
    # the burst when a burst started in (t-10, t]
    def bursty(t: float) -> float:
        return 90.0 if t > 0 and (t - 0.001) % 300 >= 290 else 0.0

    tracker, seen = run(DEFAULT, bursty, until_s=6 * 3600)
    assert not any(idle for _, idle in seen)
    worst = max(tracker.state("k", t).idle_s for t in range(0, 6 * 3600, 10))  # type: ignore[union-attr]
    assert worst <= 300
    # the same pod under a window shorter than its period is idle between bursts: the window matters
    _, short = run(IdlePolicy(window_s=240, start_grace_s=0), bursty, until_s=3600)
    assert any(idle for _, idle in short)


def test_start_grace_holds_off_idleness() -> None:
    policy = IdlePolicy(window_s=60, start_grace_s=300)
    _, seen = run(policy, lambda t: 0.0, until_s=600)
    assert not any(idle for t, idle in seen if t < 300)
    assert all(idle for t, idle in seen if t >= 300)


def test_memory_moving_by_more_than_1_percent_counts_as_activity() -> None:
    policy = IdlePolicy(window_s=120, start_grace_s=0)
    # engine at 0 %, but memory grows 2 % every minute (a loader filling a cache): never idle
    _, seen = run(policy, lambda t: 0.0, until_s=1200, memory=lambda t: int(4 * GIB * (1 + 0.02 * (t // 60))))
    assert not any(idle for _, idle in seen)
    # jitter within 1 % is not activity
    _, seen = run(policy, lambda t: 0.0, until_s=1200,
                  memory=lambda t: 4 * GIB + (1 << 20) * (int(t) % 3))
    assert any(idle for _, idle in seen)


def test_unknown_activity_and_sampling_gaps_count_as_activity() -> None:
    policy = IdlePolicy(window_s=60, start_grace_s=0, max_gap_s=30)
    _, seen = run(policy, lambda t: None, until_s=600)
    assert not any(idle for _, idle in seen)
    tracker = IdleTracker(policy)
    for t in range(0, 130, 10):
        tracker.observe("k", Sample(t, 0.0, GIB))
    assert tracker.state("k", 120).idle  # type: ignore[union-attr]
    tracker.observe("k", Sample(400, 0.0, GIB))  # nothing heard for 280 s
    state = tracker.state("k", 400)
    assert state is not None and not state.idle and state.idle_s == 0


def test_threshold_is_strict_below() -> None:
    policy = IdlePolicy(window_s=60, start_grace_s=0, threshold_pct=5)
    _, under = run(policy, lambda t: 4.9, until_s=300)
    _, at = run(policy, lambda t: 5.0, until_s=300)
    assert any(idle for _, idle in under) and not any(idle for _, idle in at)


def test_keys_are_independent_and_retain_forgets_gone_tenants() -> None:
    tracker = IdleTracker(IdlePolicy(window_s=60, start_grace_s=0))
    for t in range(0, 200, 10):
        tracker.observe(("busy", "GPU-0"), Sample(t, 50.0, GIB))
        tracker.observe(("idle", "GPU-0"), Sample(t, 0.0, GIB))
    assert tracker.state(("idle", "GPU-0"), 190).idle  # type: ignore[union-attr]
    assert not tracker.state(("busy", "GPU-0"), 190).idle  # type: ignore[union-attr]
    assert tracker.retain([("busy", "GPU-0")]) == [("idle", "GPU-0")]
    assert tracker.state(("idle", "GPU-0"), 190) is None


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        IdlePolicy(window_s=0)
    with pytest.raises(ValueError):
        IdlePolicy(threshold_pct=150)
