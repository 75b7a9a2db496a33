"""The device lists the kubelet sees, per resource, and why each device is Healthy or Unhealthy.

A device is Unhealthy when its hardware is (NVML events, see health.py) or when the whole/shared pool
says so:
  nvidia.com/gpu device of GPU g     Unhealthy while g has shared tenants (memory units in use)
  nvidia.com/gpu-memory units of g   Unhealthy while g is held whole
  MIG devices                        follow their own and their parent GPU's hardware health
Until the first pod list arrives the pool is unknown, and whole GPUs and memory units are reported
Unhealthy rather than risk handing out a GPU both ways.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpupool_deviceplugin.admission import Tenancy
from gpupool_deviceplugin.resources import PluginDevice, ResourceSpec

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class DeviceView:
    device: PluginDevice
    healthy: bool


class DeviceBoard:
    def __init__(self, resources: list[ResourceSpec], *, pool_known: bool,
                 on_hardware: Callable[[str, bool], None] | None = None) -> None:
        self.resources = {r.name: r for r in resources}
        self._on_hardware = on_hardware  # (uuid, healthy) after a hardware health change
        self._cond = threading.Condition()
        self._hw_bad: dict[str, str] = {}  # GPU or MIG UUID -> reason
        self._tenancy = Tenancy()
        self._pool_known = pool_known
        self._views: dict[str, tuple[DeviceView, ...]] = {}
        self._versions: dict[str, int] = dict.fromkeys(self.resources, 0)
        self._wakes = 0
        self.changed_at: dict[str, float] = dict.fromkeys(self.resources, time.monotonic())
        with self._cond:
            self._recompute()

    # -- inputs ----------------------------------------------------------------------------------
    def mark_unhealthy(self, uuid: str, reason: str) -> bool:
        with self._cond:
            first = uuid not in self._hw_bad
            self._hw_bad[uuid] = reason
            if first:
                self._recompute()
        if first and self._on_hardware is not None:
            self._on_hardware(uuid, False)
        return first

    def mark_healthy(self, uuid: str) -> bool:
        with self._cond:
            if self._hw_bad.pop(uuid, None) is None:
                return False
            self._recompute()
        if self._on_hardware is not None:
            self._on_hardware(uuid, True)
        return True

    def set_tenancy(self, tenancy: Tenancy, *, known: bool = True) -> None:
        with self._cond:
            if tenancy == self._tenancy and known == self._pool_known:
                return
            self._tenancy = tenancy
            self._pool_known = known
            self._recompute()

    # -- outputs ---------------------------------------------------------------------------------
    def hardware_problems(self) -> dict[str, str]:
        with self._cond:
            return dict(self._hw_bad)

    def tenancy(self) -> Tenancy:
        with self._cond:
            return self._tenancy

    def snapshot(self, resource: str) -> tuple[int, tuple[DeviceView, ...]]:
        with self._cond:
            return self._versions[resource], self._views[resource]

    def wait_for_change(self, resource: str, seen: int, timeout: float) -> tuple[int, tuple[DeviceView, ...]] | None:
        """The list once its version differs from `seen`; None after `timeout` or a `wake()`."""
        with self._cond:
            wakes = self._wakes
            self._cond.wait_for(lambda: self._versions[resource] != seen or self._wakes != wakes, timeout)
            if self._versions[resource] == seen:
                return None
            return self._versions[resource], self._views[resource]

    def wake(self) -> None:
        """Let every waiting stream re-check whether it should still run (an RPC ended)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    def is_healthy(self, resource: str, device_id: str) -> bool:
        with self._cond:
            return any(v.healthy for v in self._views[resource] if v.device.id == device_id)

    # -- internals -------------------------------------------------------------------------------
    def _recompute(self) -> None:
        changed = False
        for name, spec in self.resources.items():
            views = tuple(DeviceView(d, self._healthy(spec, d)) for d in spec.devices)
            if views != self._views.get(name):
                self._views[name] = views
                self._versions[name] += 1
                self.changed_at[name] = time.monotonic()
                changed = True
        if changed:
            self._cond.notify_all()

    def _healthy(self, spec: ResourceSpec, d: PluginDevice) -> bool:
        if d.gpu_uuid in self._hw_bad or (d.mig_uuid is not None and d.mig_uuid in self._hw_bad):
            return False
        if spec.kind == "gpu":
            return self._pool_known and not self._tenancy.shared.get(d.gpu_uuid)
        if spec.kind == "memory":
            return self._pool_known and not self._tenancy.whole.get(d.gpu_uuid)
        return True
