"""What a time-mode run records besides its counters: each decision the cycle made (kept for tests) and the
samples of allocation, queue length and fragmentation over time (the plot)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    """What the cycle did for a pod at `time`: placed it (node, GPUs), evicted `victims` (pod names) for it,
    or moved pods for it to make room on `node` (`moved`: each mover's name, destination node and GPUs)."""

    time: float
    pod: str
    node: str
    gpus: tuple[int, ...]
    victims: tuple[str, ...] = ()
    moved: tuple[tuple[str, str, tuple[int, ...]], ...] = ()


@dataclass
class Sample:
    time: float
    allocated_pct: float
    queue: int
    fragmented_pct: float | None
