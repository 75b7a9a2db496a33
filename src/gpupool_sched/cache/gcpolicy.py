"""Garbage-collector settings for a long-lived process whose state grows with the cluster.

CPython's cyclic collector makes a full pass (generation 2) whenever the objects that survived the
younger passes grew by a quarter since the last one, and a full pass walks every tracked object:
every node's view, every pod in the ledger, kopf's memory of each watched object. While a burst of
pods arrives that state grows all the time, so full passes come one after another. On the 1,000-node
benchmark (6,000 pods) the scheduler spent 5-7 s in collections (wall time, as much as 22-27 % of its
CPU time), three quarters of it in 14-17 full passes of about 280 ms each, every one a pause of the
event loop (docs/benchmarks.md).

Two settings, both common for servers of this kind:
- `freeze()` after start-up moves what start-up built (modules, the client's models, the first LIST)
  into the permanent generation, which no pass walks. Refcounting still frees those objects.
- a larger first-generation threshold: young passes come less often, and a full pass can only follow
  every `threshold1 * threshold2` young ones. Cyclic garbage is still collected, later.

`GcPauses` counts the seconds spent in the collector by generation, for /metrics.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

YOUNG_THRESHOLD = 50_000  # net allocations of tracked objects per young pass (CPython: 700)
MIDDLE_THRESHOLD = 20  # young passes per middle pass (CPython: 10)
OLD_THRESHOLD = 10  # middle passes per full pass, at most (CPython: 10)


def tune() -> None:
    """Fewer passes: call once, at process start."""
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)


def freeze_startup() -> None:
    """Collect once, then keep everything alive now out of every later pass: call after the first sync."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """Seconds spent in the cyclic collector, by generation, through `gc.callbacks`."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(int(info.get("generation", 0)), time.perf_counter() - self._started)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
