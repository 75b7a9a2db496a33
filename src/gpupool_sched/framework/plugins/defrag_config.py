"""The consolidate action's settings (`gpupool scheduler --defrag*`, and the simulator's): `DefragConfig`,
checked when made, and the background mode's time window (`parse_window`, `in_window`)."""

from __future__ import annotations

from dataclasses import dataclass

from gpupool_sched.placement.consolidation import DEFAULT_MAX_MOVERS

BACKGROUND_MODES = ("off", "idle", "window")


def parse_window(text: str) -> tuple[int, int]:
    """`HH:MM-HH:MM` (UTC) as minutes of the day (start, end); the end may be before the start (the window
    wraps midnight); equal ends are the whole day."""
    try:
        start, end = text.split("-")
        out = []
        for part in (start, end):
            hours, minutes = part.strip().split(":")
            h, m = int(hours), int(minutes)
            if not (0 <= h <= 23 and 0 <= m <= 59):
                raise ValueError
            out.append(h * 60 + m)
    except ValueError:
        raise ValueError(f"a window is HH:MM-HH:MM (UTC, 00:00..23:59), got {text!r}") from None
    return out[0], out[1]


def in_window(window: tuple[int, int], minute: int) -> bool:
    """Minute `minute` of the day (UTC) is inside `window` (`parse_window`)."""
    start, end = window
    if start == end:
        return True
    return start <= minute < end if start < end else minute >= start or minute < end


@dataclass(frozen=True, slots=True)
class DefragConfig:
    enabled: bool = True
    after_s: float = 60.0  # a pod waits this long before pods move for it
    min_runtime_s: float = 600.0  # pods younger than this never move
    max_movers: int = DEFAULT_MAX_MOVERS
    per_hour: int | None = None  # moves per hour cluster-wide; None: 1 % of the running GPU pods, at least 1
    cooldown_s: float = 3600.0  # the same pod (or its replacement) never moves twice within this
    surge_timeout_s: float = 300.0  # a surge's new replica must be Ready within this, else it is rolled back
    background: str = "off"  # background consolidation: off, idle (no GPU pod waited for `quiet_s`), window
    background_window: tuple[int, int] | None = None  # UTC minutes of the day [start, end), may wrap midnight
    background_quiet_s: float = 600.0  # idle: no GPU pod has waited for this long

    def __post_init__(self) -> None:
        if self.background not in BACKGROUND_MODES:
            raise ValueError(f"--defrag-background must be one of {', '.join(BACKGROUND_MODES)}, got "
                             f"{self.background!r}")
        if self.background != "off" and not self.enabled:
            raise ValueError("--defrag-background needs --defrag on (the same movers, budgets and reservations)")
        if self.background == "window" and self.background_window is None:
            raise ValueError("--defrag-background window needs --defrag-background-window HH:MM-HH:MM")
        if self.background_quiet_s < 0:
            raise ValueError(f"--defrag-background-quiet must not be negative, got {self.background_quiet_s}")
        if self.after_s < 0 or self.min_runtime_s < 0 or self.cooldown_s < 0:
            raise ValueError("defragmentation times must not be negative")
        if self.surge_timeout_s <= 0:
            raise ValueError(f"--defrag-surge-timeout must be positive, got {self.surge_timeout_s}")
        if self.max_movers < 1:
            raise ValueError(f"--defrag-max-movers must be at least 1, got {self.max_movers}")
        if self.per_hour is not None and self.per_hour < 0:
            raise ValueError(f"--defrag-budget must not be negative, got {self.per_hour}")
