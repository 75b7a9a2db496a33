"""Reading a pod's untrusted JSON (kube/podspec.py): `InvalidPod`, the findings it is raised from
(`_Findings`), and the readers of Kubernetes quantities and plain values, which record what is wrong in
the findings instead of raising. Quantities are rounded up, as Kubernetes does: CPU in milli, memory in
MiB; device counts are positive integers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from decimal import ROUND_CEILING, Context, Decimal
from typing import Any, TypeGuard

from kubernetes.utils import parse_quantity

MAX_DEVICES = 2**31 - 1  # a device count beyond int32 is no real request
MAX_AMOUNT = 2**62  # CPU milli / memory MiB: stays inside the core's int64 arrays
MIB = 2**20
_CTX = Context(prec=100, rounding=ROUND_CEILING, traps=[])  # rounds quantities up, as Kubernetes does
_MAX_MESSAGES = 5


class InvalidPod(ValueError):
    """The message is what the pod's FailedScheduling Event and Unschedulable condition say.

    ``permanent``: True when the pod is malformed (only a change of the pod can fix it); False when
    no node of the cluster as it is now could ever take it (unknown GPU model or MIG profile, more
    memory units than any GPU has), so it is retried when nodes change."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


class _Findings:
    """Problems found while reading a pod: malformed ones and ones only the cluster could fix."""

    def __init__(self) -> None:
        self.malformed: list[str] = []
        self.unfit: list[str] = []

    def bad(self, message: str) -> None:
        if message not in self.malformed:
            self.malformed.append(message)

    def missing(self, message: str) -> None:
        if message not in self.unfit:
            self.unfit.append(message)

    def raise_any(self) -> None:
        for messages, permanent in ((self.malformed, True), (self.unfit, False)):
            if messages:
                text = "; ".join(messages[:_MAX_MESSAGES])
                if len(messages) > _MAX_MESSAGES:
                    text += f"; and {len(messages) - _MAX_MESSAGES} more"
                raise InvalidPod(text, permanent=permanent)


def _quantity(value: Any, what: str, f: _Findings) -> Decimal | None:
    """A non-negative, finite Kubernetes quantity, or None (recorded as malformed)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        f.bad(f"{what} {_show(value)} is not a quantity")
        return None
    try:
        q = parse_quantity(value)
    except (ValueError, ArithmeticError, TypeError):
        f.bad(f"{what} {_show(value)} is not a quantity")
        return None
    if not q.is_finite() or q < 0:
        f.bad(f"{what} {_show(value)} is not a non-negative quantity")
        return None
    return q


def _amount(value: Any, what: str, scale: int, f: _Findings) -> int:
    """CPU in milli (scale 1000) or memory in MiB (scale 0), rounded up; 0 for absent or malformed."""
    if value is None:
        return 0
    q = _quantity(value, what, f)
    if q is None:
        return 0
    scaled = _CTX.multiply(q, scale) if scale else _CTX.divide(q, MIB)
    if scaled > MAX_AMOUNT:
        f.bad(f"{what} {_show(value)} is too large")
        return 0
    return int(_CTX.to_integral_value(scaled))


def _devices(value: Any, what: str, f: _Findings) -> int:
    """A device count: a positive integer (0 for anything else, recorded as malformed)."""
    q = _quantity(value, what, f)
    if q is None:
        return 0
    if q > MAX_DEVICES:
        f.bad(f"{what} {_show(value)} is too large")
        return 0
    if q != q.to_integral_value():
        f.bad(f"{what} {_show(value)} is not a whole number of devices")
        return 0
    if q == 0:
        f.bad(f"{what} is 0; ask for at least 1 or leave the resource out")
        return 0
    return int(q)


def _resource_map(value: Any, where: str, f: _Findings) -> dict[str, Any]:
    raw = _map(value, where, f)
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if not isinstance(key, str):
            f.bad(f"{where}: resource name {_show(key)} is not a string")
            continue
        out[key] = v
    return out


def _map(value: Any, where: str, f: _Findings) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        f.bad(f"{where} must be an object, got {_show(value)}")
        return {}
    return value


def _list(value: Any, where: str, f: _Findings) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        f.bad(f"{where} must be a list, got {_show(value)}")
        return []
    return list(value)


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)


def _timestamp(value: Any) -> float:
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _names(values: Iterable[str]) -> str:
    return ", ".join(sorted(values)) or "none"


def _mib(mib: int) -> str:
    if mib % 1024 == 0:
        return f"{mib // 1024} GiB"
    return f"{mib} MiB"
