"""The pure choice of idle pods to report and reclaim (framework/plugins/idle.py): plain data in, candidates
out. What it must never do matters most: a pod not listed idle, a pod annotated never, a pod in its start
grace, a gang member alone, anything past the budget or under a policy that does not reclaim."""

from __future__ import annotations

import pytest

from gpupool_sched.framework.plugins.idle import (
    NONE,
    RECLAIM,
    REPORT,
    WHEN_NEEDED,
    IdleBudget,
    IdleCandidate,
    IdlePod,
    IdlePolicy,
    IdleReclaimConfig,
    PolicyOf,
    describe_duration,
    idle_past,
    parse_duration,
    parse_policy,
    reclaimable,
)

NOW = 1_000_000.0
HOUR = 3600.0


def pod(uid: str, idle_s: float, *, ns: str = "team", started_s: float = 10 * HOUR, never: bool = False,
        gang: str | None = None) -> IdlePod:
    return IdlePod(uid, f"{ns}/{uid}", "n1", NOW - idle_s, NOW - started_s, 1.0, never, gang)


def policy(action: str, after: float = HOUR) -> IdlePolicy:
    return IdlePolicy(action, after)


def every(action: str, after: float = HOUR) -> PolicyOf:
    return lambda namespace: policy(action, after)


def uids(candidates: list[IdleCandidate]) -> list[str]:
    return [c.pod.uid for c in candidates]


def choose(pods: list[IdlePod], policy_of: PolicyOf, *, actions: tuple[str, ...] = (WHEN_NEEDED, RECLAIM),
           gangs: dict[str, set[str]] | None = None, grace: float = 300.0, budget: int = 10) -> list[IdleCandidate]:
    return reclaimable(pods, policy_of, NOW, actions=actions, gangs=gangs or {}, start_grace_s=grace,
                       budget_left=budget)


def test_only_pods_idle_past_idle_after_longest_first() -> None:
    pods = [pod("short", 0.5 * HOUR), pod("long", 3 * HOUR), pod("just", HOUR)]
    assert uids(idle_past(pods, every(RECLAIM), NOW)) == ["long", "just"]
    assert uids(choose(pods, every(RECLAIM))) == ["long", "just"]


def test_no_policy_counts_as_none_and_reclaims_nothing() -> None:
    pods = [pod("a", 2 * HOUR)]
    past = idle_past(pods, lambda ns: None, NOW)
    assert [c.policy.action for c in past] == [NONE]
    assert choose(pods, lambda ns: None) == []


@pytest.mark.parametrize("action", [NONE, REPORT])
def test_none_and_report_never_reclaim(action: str) -> None:
    pods = [pod("a", 5 * HOUR)]
    assert uids(idle_past(pods, every(action), NOW)) == ["a"]  # counted (metrics, report Events)
    assert choose(pods, every(action), actions=(NONE, REPORT, WHEN_NEEDED, RECLAIM)) == []


def test_the_caller_picks_which_reclaiming_actions() -> None:
    pods = [pod("needed", 2 * HOUR, ns="a"), pod("policy", 2 * HOUR, ns="b")]
    by_ns = {"a": policy(WHEN_NEEDED), "b": policy(RECLAIM)}
    assert uids(choose(pods, by_ns.get, actions=(RECLAIM,))) == ["policy"]  # the sweep
    assert sorted(uids(choose(pods, by_ns.get, actions=(WHEN_NEEDED, RECLAIM)))) == ["needed", "policy"]


def test_policy_per_namespace_overrides() -> None:
    pods = [pod("a", 2 * HOUR, ns="quick"), pod("b", 2 * HOUR, ns="slow")]
    by_ns = {"quick": policy(RECLAIM, HOUR), "slow": policy(RECLAIM, 3 * HOUR)}
    assert uids(choose(pods, by_ns.get)) == ["a"]


def test_never_annotation() -> None:
    assert choose([pod("a", 5 * HOUR, never=True)], every(RECLAIM)) == []


def test_start_grace() -> None:
    young = pod("young", 2 * HOUR, started_s=200)
    assert choose([young], every(RECLAIM, after=0), grace=300) == []
    assert uids(choose([young], every(RECLAIM, after=0), grace=100)) == ["young"]


def test_gang_whole_or_not_at_all() -> None:
    a, b = pod("a", 2 * HOUR, gang="ns/g"), pod("b", 2 * HOUR, gang="ns/g")
    busy_member = {"ns/g": {"a", "b", "c"}}  # c runs and is not listed idle
    assert choose([a, b], every(RECLAIM), gangs=busy_member) == []
    assert sorted(uids(choose([a, b], every(RECLAIM), gangs={"ns/g": {"a", "b"}}))) == ["a", "b"]
    never_b = pod("b", 2 * HOUR, gang="ns/g", never=True)
    assert choose([a, never_b], every(RECLAIM), gangs={"ns/g": {"a", "b"}}) == []
    young_b = pod("b", 2 * HOUR, gang="ns/g", started_s=60)
    assert choose([a, young_b], every(RECLAIM), gangs={"ns/g": {"a", "b"}}) == []


def test_budget_caps_the_pods_and_a_gang_fits_whole_or_is_skipped() -> None:
    pods = [pod("p1", 5 * HOUR), pod("g1", 4 * HOUR, gang="g"), pod("g2", 4 * HOUR, gang="g"), pod("p2", 3 * HOUR)]
    gangs = {"g": {"g1", "g2"}}
    assert choose(pods, every(RECLAIM), gangs=gangs, budget=0) == []
    assert uids(choose(pods, every(RECLAIM), gangs=gangs, budget=1)) == ["p1"]
    assert uids(choose(pods, every(RECLAIM), gangs=gangs, budget=2)) == ["p1", "p2"]  # the gang does not fit
    assert uids(choose(pods, every(RECLAIM), gangs=gangs, budget=3)) == ["p1", "g1", "g2"]


def test_budget_rolls_over_an_hour() -> None:
    now = [0.0]
    budget = IdleBudget(2, lambda: now[0])
    budget.spend(2)
    assert budget.left() == 0
    now[0] = 3599.0
    assert budget.left() == 0
    now[0] = 3600.0
    assert budget.left() == 2
    assert IdleBudget(0, lambda: 0.0).left() == 0


@pytest.mark.parametrize(("text", "seconds"), [(90, 90.0), ("1h", 3600.0), ("30m", 1800.0), ("1h30m", 5400.0),
                                               ("45s", 45.0), (0, 0.0)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1d", "h", "-5", -5, True, 1.5, "1h-1m"])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_policy_spec() -> None:
    problems: list[str] = []
    assert parse_policy({"idleAfter": "30m"}, "spec.idleReclaim", problems) == IdlePolicy(WHEN_NEEDED, 1800.0)
    assert parse_policy({"action": "report"}, "spec.idleReclaim", problems) == IdlePolicy(REPORT, HOUR)
    assert parse_policy(None, "spec.idleReclaim", problems) is None
    assert problems == []
    parse_policy({"action": "evict", "idleAfter": "soon", "when": 1}, "spec.idleReclaim", problems)
    assert problems == [
        "unknown field spec.idleReclaim.when (known: idleAfter, action)",
        "spec.idleReclaim.action must be one of none, report, reclaimWhenNeeded, reclaim, not 'evict'",
        "spec.idleReclaim.idleAfter: 'soon' is not a duration (seconds, or like 1h, 30m, 1h30m, 90s)",
    ]


def test_config_refuses_an_unknown_action() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        IdleReclaimConfig(action="sometimes")


def test_describe_duration() -> None:
    assert [describe_duration(s) for s in (40, 1500, 3600, 4320, 61)] == ["40s", "25m", "1h", "1h12m", "1m01s"]
