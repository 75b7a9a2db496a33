"""Idle GPUs (issue 20 §2, docs/idle-and-elastic.md): which pods the device plugins list idle are past their
policy's `idleAfter`, and which of those may be reclaimed now. Pure: plain data in (the idle pods with their
since-times, a policy per namespace, the time, the budget left), candidates out; the reclaim-idle action
(framework/actions/reclaim_idle.py) and the service's sweep (scheduler/idle.py) feed it.

A policy is the scheduler-wide default (`--idle-reclaim-action`, `--idle-after`) or a GpuQuota's
`spec.idleReclaim`, which overrides it for the namespaces the quota selects. Its action:

    none               nothing (the default: nothing happens until an operator asks)
    report             an Event on the pod once per idle spell, and the metrics
    reclaimWhenNeeded  evicted only for a pending pod within its guarantee or of higher priority that fits
                       once it goes (the default action of a policy that names none)
    reclaim            evicted once idle past idleAfter (the service's sweep, within the hourly budget)

Never a candidate: a pod the plugins do not list idle (false positives are the failure that matters), a pod
annotated `gpupool.io/idle-reclaim: "never"`, a pod in its start grace, a gang member whose gang is not
idle and reclaimable whole, anything beyond the reclaim budget per hour.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

NONE, REPORT, WHEN_NEEDED, RECLAIM = "none", "report", "reclaimWhenNeeded", "reclaim"
ACTIONS = (NONE, REPORT, WHEN_NEEDED, RECLAIM)
RECLAIMING = frozenset((WHEN_NEEDED, RECLAIM))  # what the reclaim-idle action may take for a pending pod
NEVER_ANNOTATION = "gpupool.io/idle-reclaim"  # "never": this pod is never reclaimed for being idle
DEFAULT_IDLE_AFTER_S = 3600.0
DEFAULT_BUDGET_PER_HOUR = 10
DEFAULT_START_GRACE_S = 300.0  # as the plugin's --idle-start-grace: a pod this young is never reclaimed
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


@dataclass(frozen=True, slots=True)
class IdleReclaimConfig:
    """The scheduler-wide default policy and the limits every policy shares."""

    action: str = NONE
    idle_after_s: float = DEFAULT_IDLE_AFTER_S
    budget_per_hour: int = DEFAULT_BUDGET_PER_HOUR  # idle reclaims per hour across the cluster (0: none)
    start_grace_s: float = DEFAULT_START_GRACE_S

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"idle reclaim action must be one of {', '.join(ACTIONS)}, not {self.action!r}")


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    action: str
    idle_after_s: float
    source: str = "default"  # "default" or "GpuQuota <name>": which policy applies, for Events


def parse_duration(value: object) -> float:
    """Seconds: a non-negative whole number, or a duration string such as "1h", "30m", "1h30m", "90s".
    ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return float(value)
    if isinstance(value, str) and value:
        match = _DURATION.match(value.strip())
        if match and any(match.groups()):
            h, m, s = (int(g or 0) for g in match.groups())
            return float(h * 3600 + m * 60 + s)
    raise ValueError(f"{value!r} is not a duration (seconds, or like 1h, 30m, 1h30m, 90s)")


def parse_policy(value: object, path: str, problems: list[str]) -> IdlePolicy | None:
    """A GpuQuota's `spec.idleReclaim`; problems appended with their field paths. None when absent."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"{path} must be an object with idleAfter and action")
        return None
    for key in sorted(set(value) - {"idleAfter", "action"}, key=str):
        problems.append(f"unknown field {path}.{key} (known: idleAfter, action)")
    action = value.get("action", WHEN_NEEDED)
    if action not in ACTIONS:
        problems.append(f"{path}.action must be one of {', '.join(ACTIONS)}, not {action!r}")
        action = NONE
    try:
        after = parse_duration(value.get("idleAfter", int(DEFAULT_IDLE_AFTER_S)))
    except ValueError as exc:
        problems.append(f"{path}.idleAfter: {exc}")
        after = DEFAULT_IDLE_AFTER_S
    return IdlePolicy(str(action), after)


def describe_duration(seconds: float) -> str:
    """1h12m, 25m, 40s."""
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m" if m else f"{h}h"
    if m:
        return f"{m}m{sec:02d}s" if sec else f"{m}m"
    return f"{sec}s"


@dataclass(frozen=True, slots=True)
class IdlePod:
    """A running pod a device plugin lists idle on its node."""

    uid: str
    key: str  # namespace/name
    node: str
    idle_since: float  # seconds since the epoch
    started: float  # seconds since the epoch (status.startTime)
    gpus: float = 0.0  # GPUs it holds (a memory-unit tenant: its fraction of the GPU)
    never: bool = False  # gpupool.io/idle-reclaim: "never"
    gang: str | None = None  # its PodGroup, if any
    priority: int = 0

    @property
    def namespace(self) -> str:
        return self.key.partition("/")[0]


@dataclass(frozen=True, slots=True)
class IdleCandidate:
    pod: IdlePod
    policy: IdlePolicy
    idle_s: float  # how long it has been idle


PolicyOf = Callable[[str], IdlePolicy | None]  # namespace -> its policy (None: no policy)


def idle_past(pods: Iterable[IdlePod], policy_of: PolicyOf, now: float) -> list[IdleCandidate]:
    """The pods idle past their policy's idleAfter (the default's when no policy applies, as action none),
    longest idle first."""
    out = []
    for pod in pods:
        policy = policy_of(pod.namespace) or IdlePolicy(NONE, DEFAULT_IDLE_AFTER_S)
        idle_s = now - pod.idle_since
        if idle_s >= policy.idle_after_s:
            out.append(IdleCandidate(pod, policy, idle_s))
    out.sort(key=lambda c: (c.pod.idle_since, c.pod.uid))
    return out


def reclaimable(pods: Iterable[IdlePod], policy_of: PolicyOf, now: float, *, actions: Collection[str],
                gangs: Mapping[str, Collection[str]], start_grace_s: float, budget_left: int) -> list[IdleCandidate]:
    """The pods that may be reclaimed now under a policy whose action is in `actions`, longest idle first,
    whole gangs only, at most `budget_left` pods. `gangs`: each PodGroup's running members (a gang is
    reclaimable only when every one of them is)."""
    if budget_left <= 0:
        return []
    eligible = [c for c in idle_past(pods, policy_of, now)
                if c.policy.action in actions and c.policy.action in RECLAIMING and not c.pod.never
                and now - c.pod.started >= start_grace_s]
    uids = {c.pod.uid for c in eligible}
    out: list[IdleCandidate] = []
    taken: set[str] = set()
    for candidate in eligible:
        if candidate.pod.uid in taken:
            continue
        group = [candidate]
        if candidate.pod.gang is not None:
            members = set(gangs.get(candidate.pod.gang, ())) | {candidate.pod.uid}
            if not members <= uids:
                continue  # a member alone is never reclaimed: the gang whole, or not at all
            group = [c for c in eligible if c.pod.uid in members]
        if len(out) + len(group) > budget_left:
            continue
        out.extend(group)
        taken.update(c.pod.uid for c in group)
    return out


class IdleBudget:
    """Idle reclaims per rolling hour across the cluster (both the reclaim-idle action's and the sweep's)."""

    def __init__(self, per_hour: int, clock: Callable[[], float]) -> None:
        self.per_hour = per_hour
        self.clock = clock
        self.spent: deque[float] = deque()

    def left(self) -> int:
        now = self.clock()
        while self.spent and self.spent[0] <= now - 3600.0:
            self.spent.popleft()
        return max(0, self.per_hour - len(self.spent))

    def spend(self, n: int = 1) -> None:
        now = self.clock()
        self.spent.extend([now] * n)

    def refund(self) -> None:
        """The last reclaim spent did not happen (its eviction was refused)."""
        if self.spent:
            self.spent.pop()
