"""Idleness per (pod, GPU): a pure tracker fed with timestamped samples (no I/O, no clock of its own).

Definition (docs/idle-and-elastic.md): a pod is idle on a GPU when, for the whole window,
  - its engine activity stayed below `threshold_pct` (default 1 %), and
  - its memory used did not change by more than `memory_change_pct` (default 1 %) of the last active level,
and it has been a tenant of that GPU for longer than `start_grace_s` (default 5 min). (The sampler also
feeds "unknown" while the pod's containers do not run or are within the grace of their start, so the
window starts after the containers' own grace.)

Everything uncertain counts as activity, so that a pod can only ever look busier than it is, never idler:
an unknown activity (NVML could not say), the first sample of a tenant, and a gap between samples longer
than `max_gap_s` (the sampler stalled: nobody knows what happened meanwhile).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class IdlePolicy:
    window_s: float = 600.0
    threshold_pct: float = 1.0
    memory_change_pct: float = 1.0
    start_grace_s: float = 300.0
    max_gap_s: float = 30.0  # 3 sample intervals by default: a longer silence is not evidence of idleness

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.max_gap_s <= 0:
            raise ValueError("window_s and max_gap_s must be positive")
        if not 0 <= self.threshold_pct <= 100 or self.memory_change_pct < 0 or self.start_grace_s < 0:
            raise ValueError("threshold_pct is 0..100, memory_change_pct and start_grace_s are >= 0")


@dataclass(frozen=True)
class Sample:
    """What one sampling round saw for one pod on one GPU.

    `activity_pct`: the highest engine activity since the previous round (NVML keeps a buffer of samples;
    the sampler reads every one since its last read, so a short burst between two rounds is not missed);
    None when unknown. `memory_used`: bytes, None when unknown (then memory decides nothing)."""

    t: float
    activity_pct: float | None
    memory_used: int | None = None


@dataclass(frozen=True)
class IdleState:
    idle_s: float         # seconds since the last activity (or since the tenant was first seen)
    idle: bool            # idle under the policy: idle_s >= window and past the start grace
    in_grace: bool
    last_activity_pct: float | None
    last_memory_used: int | None


@dataclass
class _Track:
    first_seen: float
    last_active: float
    last_t: float
    memory_ref: int | None
    last: Sample


class IdleTracker(Generic[K]):
    """Per key (e.g. (pod UID, GPU UUID)), when activity was last seen. Not thread-safe: one sampler feeds it."""

    def __init__(self, policy: IdlePolicy) -> None:
        self.policy = policy
        self._tracks: dict[K, _Track] = {}

    def observe(self, key: K, sample: Sample) -> None:
        p = self.policy
        track = self._tracks.get(key)
        if track is None:
            self._tracks[key] = _Track(sample.t, sample.t, sample.t, sample.memory_used, sample)
            return
        if sample.t < track.last_t:
            return  # out of order: ignore
        active = sample.activity_pct is None or sample.activity_pct >= p.threshold_pct
        if sample.t - track.last_t > p.max_gap_s:
            active = True  # a silence is not evidence
        mem = sample.memory_used
        if mem is not None:
            if track.memory_ref is None:
                track.memory_ref = mem
            elif abs(mem - track.memory_ref) > p.memory_change_pct / 100 * max(track.memory_ref, 1):
                active = True
        if active:
            track.last_active = sample.t
            if mem is not None:
                track.memory_ref = mem
        track.last_t = sample.t
        track.last = sample

    def state(self, key: K, now: float) -> IdleState | None:
        track = self._tracks.get(key)
        if track is None:
            return None
        idle_s = max(0.0, now - track.last_active)
        in_grace = now - track.first_seen < self.policy.start_grace_s
        return IdleState(idle_s, idle_s >= self.policy.window_s and not in_grace, in_grace,
                         track.last.activity_pct, track.last.memory_used)

    def tracked(self) -> list[K]:
        return list(self._tracks)

    def retain(self, keys: Iterable[K]) -> list[K]:
        """Forget every key not in `keys` (tenants gone); returns the keys forgotten."""
        keep = set(keys)
        gone = [k for k in self._tracks if k not in keep]
        for k in gone:
            del self._tracks[k]
        return gone
