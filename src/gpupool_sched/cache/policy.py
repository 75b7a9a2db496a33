"""The placement policy for the workload seen so far, as the scheduler and the extender keep it.

Each pod's request enters a rolling workload profile once (by UID). The policy is built again when
the profile's version moves (FGD scores against the profile), and the snapshot's FGD caches of the
profile it replaces are dropped."""

from __future__ import annotations

from collections.abc import Callable

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import Policy
from gpupool_sched.placement.registry import POLICIES, build_policy
from gpupool_sched.placement.workload import RollingProfile, forget_profile


class PolicyCache:
    """Policy `name` built for the current workload profile; `on_rebuilt(version)` after each build."""

    def __init__(self, name: str, state: ClusterState, *, window: int,
                 on_rebuilt: Callable[[int], object] | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
        self.name = name
        self.state = state
        self.profile = RollingProfile(window=window)
        self.on_rebuilt = on_rebuilt
        self._window = window
        self._policy: Policy | None = None
        self._policy_version = -1
        self._profile_in_use: WorkloadProfile | None = None
        self._observed: set[str] = set()  # UIDs whose request entered the profile

    def current(self) -> Policy:
        profile = self.profile.profile()
        if self._policy is None or self.profile.version != self._policy_version:
            if self._profile_in_use is not None and self._profile_in_use is not profile:
                forget_profile(self.state.snapshot, self._profile_in_use)  # its FGD caches
            self._profile_in_use = profile
            info = POLICIES[self.name]
            self._policy = build_policy(self.name, profile if info.needs_profile else None)
            self._policy_version = self.profile.version
            if self.on_rebuilt is not None:
                self.on_rebuilt(self.profile.version)
        return self._policy

    def observed(self, uid: str) -> bool:
        """Whether the pod's request is in the profile already."""
        return uid in self._observed

    def observe(self, uid: str, request: PodRequest) -> None:
        """The pod's request into the profile, once."""
        if uid in self._observed:
            return
        self._observed.add(uid)
        if len(self._observed) > 4 * self._window:
            self._observed.clear()
        self.profile.observe(request)
