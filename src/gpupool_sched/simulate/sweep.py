"""Run a sweep: every run of a grid (sweep_grid.py) whose result is not on disk yet, in local processes
or on a Ray cluster (sweep_ray.py), one result file per run.

A run is a pure function of its :class:`RunConfig`: :func:`run_one` reads the trace, prepares the
seeded arrivals and replays one policy with the simulator's own functions (run.py), and returns the
report as JSON text with the wall time kept apart, so that the same config gives byte-identical result
files wherever it runs. Results are written atomically (a temporary file renamed into place) as
``<out>/runs/<key>.json``, the wall time as ``<out>/timing/<key>.json``; a sweep run again reads the
result files back and runs only the runs whose file is missing or unreadable.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from gpupool_sched.simulate.run import Workload, bound_report, prepare_workload, simulate
from gpupool_sched.simulate.sweep_grid import BOUND, RunConfig, TraceFiles
from gpupool_sched.simulate.trace import Trace, read_trace

RESULT_FORMAT = 1  # the result file's layout; a file of another format is run again


@dataclass(frozen=True, slots=True)
class RunOutput:
    """What a run hands back: its key, the result file's text and its wall time (seconds)."""

    key: str
    result_json: str
    seconds: float


@lru_cache(maxsize=4)
def _trace(files: TraceFiles) -> Trace:
    nodes, pods = files.paths()
    return read_trace(nodes, pods)


@lru_cache(maxsize=16)
def _workload(files: TraceFiles, seed: int, ratio: float) -> Workload:
    return prepare_workload(_trace(files), seed, None, ratio)


def run_one(config: RunConfig) -> RunOutput:
    """One run. Trace and arrivals are cached per process (a worker usually gets several policies of the
    same trace and seed); the result depends on the config alone."""
    import time

    start = time.perf_counter()
    result: dict[str, Any]
    if config.parameters.mode == "time":
        result = _time_result(config)
    elif config.policy == BOUND:
        workload = _workload(config.trace, config.seed, config.parameters.ratio)
        result = bound_report(_trace(config.trace), workload).model_dump()
        result.pop("seconds")
    else:
        p = config.parameters
        trace, workload = _trace(config.trace), _workload(config.trace, config.seed, p.ratio)
        report = simulate(trace, workload, [config.policy], sample_percentage=p.sample_percentage,
                          sample_rotate=p.sample_scan == "rotating", profile_source=p.profile_source)[0]
        result = report.model_dump()
        result["final"].pop("seconds")
    payload = {
        "format": RESULT_FORMAT,
        "key": config.key,
        "config": config.canonical(),
        "result": result,
    }
    text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
    return RunOutput(config.key, text, round(time.perf_counter() - start, 3))


def _time_result(config: RunConfig) -> dict[str, Any]:
    """One run of the simulator in time (timerun.py, as `--mode time` runs one load), wall times left out."""
    from gpupool_sched.framework.plugins.defrag_config import DefragConfig
    from gpupool_sched.simulate.timegangs import GangSpec
    from gpupool_sched.simulate.timerun import DAY_S, TimeSettings, run_load, trace_pods, workload_profile

    p = config.parameters
    trace = _trace(config.trace)
    settings = TimeSettings((p.load,), p.days * DAY_S, p.horizon_days * DAY_S, p.patience_s, config.seed,
                            config.policy, p.samples, DefragConfig(enabled=p.defrag == "on"),
                            None if p.gangs is None else GangSpec.parse(p.gangs))
    pods = trace_pods(trace, config.trace.paths()[1], settings)
    result = run_load(trace, pods, workload_profile(trace), settings, p.load).json()
    for wall in ("seconds", "placement_seconds"):
        result.pop(wall)
    return result


def write_atomically(path: Path, text: str) -> None:
    """The file has either its old content or all of ``text``, never part of it (a killed sweep leaves
    no half-written result that a later one would take for finished)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_result(out: Path, key: str) -> dict[str, Any] | None:
    """The finished result of run ``key``, or None when its file is missing, partial, corrupt or of
    another run or format (such a run is run again)."""
    try:
        data = json.loads((out / "runs" / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != RESULT_FORMAT or data.get("key") != key:
        return None
    if not isinstance(data.get("result"), dict) or not isinstance(data.get("config"), dict):
        return None
    return data


def read_seconds(out: Path, key: str) -> float | None:
    try:
        value = json.loads((out / "timing" / f"{key}.json").read_text()).get("seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


class Backend(Protocol):
    """Runs configs and calls ``done`` with each output as it arrives (in any order)."""

    def __call__(self, configs: Sequence[RunConfig], done: Callable[[RunOutput], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class LocalProcesses:
    """Runs on this machine, ``workers`` processes (one run each at a time)."""

    workers: int

    def __call__(self, configs: Sequence[RunConfig], done: Callable[[RunOutput], None]) -> None:
        if not configs:
            return
        if self.workers == 1:  # no pool: the same function in this process
            for config in configs:
                done(run_one(config))
            return
        with ProcessPoolExecutor(max_workers=min(self.workers, len(configs))) as pool:
            futures = [pool.submit(run_one, c) for c in _by_trace_and_seed(configs)]
            for future in as_completed(futures):
                done(future.result())


def _by_trace_and_seed(configs: Iterable[RunConfig]) -> list[RunConfig]:
    """Runs of the same trace and seed next to each other, so a worker's cached arrivals get reused."""
    return sorted(configs, key=lambda c: (c.trace.label, c.seed, c.parameters.mode, c.parameters.ratio))


@dataclass(slots=True)
class SweepOutcome:
    total: int
    skipped: int = 0
    ran: int = 0
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> result file content
    seconds: dict[str, float] = field(default_factory=dict)  # key -> wall time of the run


def run_sweep(
    runs: Sequence[RunConfig],
    out: Path,
    backend: Backend,
    on_progress: Callable[[int, int], None] | None = None,
) -> SweepOutcome:
    """Every run whose result is not in ``out`` yet, through ``backend``; the results of all of them.
    ``on_progress(done, skipped)`` is called once the finished ones are known and after each run."""
    outcome = SweepOutcome(total=len(runs))
    todo: list[RunConfig] = []
    for config in runs:
        found = read_result(out, config.key)
        if found is None:
            todo.append(config)
        else:
            outcome.results[config.key] = found
            outcome.skipped += 1
            seconds = read_seconds(out, config.key)
            if seconds is not None:
                outcome.seconds[config.key] = seconds
    if on_progress:
        on_progress(outcome.skipped, outcome.skipped)

    def done(output: RunOutput) -> None:
        write_atomically(out / "runs" / f"{output.key}.json", output.result_json)
        write_atomically(out / "timing" / f"{output.key}.json", json.dumps({"seconds": output.seconds}) + "\n")
        outcome.results[output.key] = json.loads(output.result_json)
        outcome.seconds[output.key] = output.seconds
        outcome.ran += 1
        if on_progress:
            on_progress(outcome.skipped + outcome.ran, outcome.skipped)

    backend(todo, done)
    return outcome


def combined_json(runs: Sequence[RunConfig], outcome: SweepOutcome) -> dict[str, Any]:
    """Every run's config and result in grid order, with its wall time beside the result."""
    items = []
    for config in runs:
        data = outcome.results[config.key]
        items.append({"key": config.key, "config": data["config"], "result": data["result"],
                      "seconds": outcome.seconds.get(config.key)})
    return {"runs": items, "total": outcome.total, "skipped": outcome.skipped, "ran": outcome.ran}
