"""A sweep's grid file -> its run list: one :class:`RunConfig` per point of traces x seeds x parameters x
policies, each with a key that names its result.

The key is a hash of the run's canonical config (parameters at their default value left out, so that a
parameter added later, such as a replay ``mode``, leaves the keys of existing runs alone), the content
hash of its trace files and the gpupool version: a result on disk under that key is the result of that
exact run, and a sweep run again skips it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpupool_sched.errors import UserError
from gpupool_sched.placement.registry import POLICIES
from gpupool_sched.simulate.arrivals import DEFAULT_RATIO
from gpupool_sched.simulate.lifetimes import DEFAULT_PATIENCE_S
from gpupool_sched.simulate.run import ProfileSource
from gpupool_sched.simulate.trace import BUNDLED_NODES, BUNDLED_PODS, bundled_path

BOUND = "bound"  # the pseudo-policy of a run that computes only the lower bound (grid key `bound: true`)
OPENB_NODES = "openb_node_list_gpu_node.csv"
_FAMILY = re.compile(r"[A-Za-z0-9_]+")
MAX_SEED = 2**63 - 1


ARRIVALS_KNOBS = frozenset({"ratio", "sample_percentage", "sample_scan", "profile_source"})
TIME_KNOBS = frozenset({"load", "days", "horizon_days", "patience_s", "samples", "defrag", "gangs"})


class RunParameters(BaseModel):
    """Every knob of one replay besides trace, seed and policy. A new knob (a replay ``mode``, a ``load``)
    is a new field here with its default: it becomes a grid key and leaves old run keys unchanged."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["arrivals", "time"] = "arrivals"  # the FGD replay, or the simulator in time (--mode time)
    # the arrivals replay's knobs
    ratio: float = Field(default=DEFAULT_RATIO, gt=0, le=10, description="arrivals up to this multiple of GPU capacity")
    sample_percentage: int | None = Field(default=None, ge=0, le=100)
    sample_scan: Literal["fixed", "rotating"] = "fixed"
    profile_source: ProfileSource = "trace"
    # the time mode's (--load, --days, --horizon, --patience; samples: points of the series over time)
    load: float = Field(default=1.0, gt=0, le=10, description="offered GPU load, a share of capacity")
    days: float = Field(default=1.0, gt=0, le=365, description="simulated days measured")
    horizon_days: float = Field(default=7.0, gt=0, le=365, description="lifetimes capped at this many days")
    patience_s: float = Field(default=DEFAULT_PATIENCE_S, ge=0, le=10**8)
    samples: int = Field(default=0, ge=0, le=10_000, description="points of allocation and queue over time")
    defrag: Literal["on", "off"] = "on"  # --defrag: the consolidate action, on by default as in the scheduler
    gangs: str | None = None  # --gangs SHARE:SIZE (simulate/timegangs.py); None: no gangs

    @field_validator("gangs", mode="before")
    @classmethod
    def _gang_spec(cls, value: Any) -> str | None:
        """SHARE:SIZE as --gangs takes it, kept in one spelling ('0.50:4' is '0.5:4'). YAML reads an unquoted
        1:8 as a number (base 60), so anything but a string is refused with a hint."""
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"gangs: write SHARE:SIZE as a quoted string, e.g. '0.5:4' (got {value!r})")
        from gpupool_sched.simulate.timegangs import GangSpec

        return str(GangSpec.parse(value))

    @model_validator(mode="after")
    def _knobs_of_its_mode(self) -> RunParameters:
        """A knob of the other mode is refused, not ignored (as on the command line)."""
        other = ARRIVALS_KNOBS if self.mode == "time" else TIME_KNOBS
        given = sorted(other & self.model_fields_set)
        if given:
            raise ValueError(f"{', '.join(given)}: not a parameter of mode {self.mode}")
        return self


class TraceFiles(BaseModel):
    """A trace as the sweep names it (``label``) and the files it is read from (None: the bundled one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str
    nodes: str | None = None
    pods: str | None = None

    def paths(self) -> tuple[Path, Path]:
        if self.nodes is None or self.pods is None:
            return bundled_path(BUNDLED_NODES), bundled_path(BUNDLED_PODS)
        return Path(self.nodes), Path(self.pods)


class RunConfig(BaseModel):
    """One run of a sweep: a pure function of this (and the trace files' content) gives its result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trace: TraceFiles
    seed: int
    policy: str
    parameters: RunParameters = RunParameters()
    trace_sha256: str = Field(description="content hash of the node and pod files")
    gpupool_version: str

    @property
    def key(self) -> str:
        return run_key(self)

    def canonical(self) -> dict[str, Any]:
        """What the key hashes: file paths left out (the content hash stands for them, so a trace moved
        to another directory, or mounted elsewhere on a Ray node, keeps its results), parameters at their
        default left out (a parameter added later does not change existing keys)."""
        return {
            "trace": self.trace.label,
            "trace_sha256": self.trace_sha256,
            "seed": self.seed,
            "policy": self.policy,
            "parameters": self.parameters.model_dump(exclude_defaults=True),
            "gpupool_version": self.gpupool_version,
        }


def run_key(config: RunConfig) -> str:
    text = json.dumps(config.canonical(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class GridFile(BaseModel):
    """The grid file's schema (YAML; JSON is YAML too)."""

    model_config = ConfigDict(extra="forbid")

    traces: list[str | dict[str, str]] = Field(min_length=1)
    seeds: list[int] = Field(min_length=1)
    policies: list[str] | str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)
    bound: bool = False
    traces_dir: str | None = None
    nodes: str | None = None

    @field_validator("seeds")
    @classmethod
    def _seeds_in_range(cls, seeds: list[int]) -> list[int]:
        for seed in seeds:
            if not 0 <= seed <= MAX_SEED:
                raise ValueError(f"seed {seed} is not in 0..{MAX_SEED}")
        return seeds


@dataclass(frozen=True, slots=True)
class Grid:
    """The run list of a grid file, in grid order (traces, seeds, parameters, policies)."""

    source: Path
    runs: tuple[RunConfig, ...]


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']}"


def read_grid_file(path: Path) -> GridFile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--grid {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--grid {path}: not UTF-8 text; expected a YAML or JSON grid file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"--grid {path}: {where}not valid YAML/JSON: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"--grid {path}: expected a mapping with traces, seeds, policies (and parameters)")
    try:
        return GridFile.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"--grid {path}: {_first_error(exc)}") from None


def _policies(grid: GridFile, source: Path) -> list[str]:
    items = [grid.policies] if isinstance(grid.policies, str) else grid.policies
    names: list[str] = []
    for item in items:
        for name in POLICIES if item == "all" else (item,):
            if name not in POLICIES:
                raise UserError(f"--grid {source}: policies: unknown policy {name!r}; choose from "
                                f"{', '.join(POLICIES)}, all")
            if name not in names:
                names.append(name)
    return names


def _parameter_points(grid: GridFile, source: Path) -> list[RunParameters]:
    known = RunParameters.model_fields
    axes: list[tuple[str, list[Any]]] = []
    for name, value in grid.parameters.items():
        if name not in known:
            raise UserError(f"--grid {source}: parameters: unknown parameter {name!r}; known: {', '.join(known)}")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise UserError(f"--grid {source}: parameters.{name}: empty list")
        axes.append((name, values))
    # both modes in one grid: each point takes the knobs of its own mode only
    both_modes = len(set(dict(axes).get("mode", ()))) > 1
    points: list[RunParameters] = []
    for combo in itertools.product(*(values for _, values in axes)):
        point = dict(zip((n for n, _ in axes), combo, strict=True))
        if both_modes:
            other = ARRIVALS_KNOBS if point["mode"] == "time" else TIME_KNOBS
            point = {k: v for k, v in point.items() if k not in other}
        try:
            params = RunParameters(**point)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = "".join(f".{p}" for p in err["loc"])
            raise UserError(f"--grid {source}: parameters{where}: {err['msg']}") from None
        if params not in points:
            points.append(params)
    return points


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def resolve_traces(grid: GridFile, source: Path, traces_dir: Path | None) -> list[TraceFiles]:
    """``default``: the bundled trace; a family name (``gpushare40``): ``openb_pod_list_<name>.csv`` in the
    traces directory (--traces-dir, else the grid's ``traces_dir``) with its GPU node list; a path to a pod
    list: with the grid's ``nodes`` file (else the traces directory's node list); ``{nodes: ..., pods: ...}``:
    those two files. Relative paths in the grid file are relative to the grid file."""
    base = source.parent
    tdir = traces_dir or (_resolve(base, grid.traces_dir) if grid.traces_dir else None)
    shared_nodes = _resolve(base, grid.nodes) if grid.nodes else (tdir / OPENB_NODES if tdir else None)
    out: list[TraceFiles] = []
    for item in grid.traces:
        if isinstance(item, dict):
            if set(item) != {"nodes", "pods"}:
                raise UserError(f"--grid {source}: traces: a mapping needs exactly 'nodes' and 'pods', got "
                                f"{', '.join(sorted(item)) or 'nothing'}")
            nodes, pods = _resolve(base, item["nodes"]), _resolve(base, item["pods"])
            label = pods.name
        elif item == "default":
            out.append(TraceFiles(label="default"))
            continue
        elif _FAMILY.fullmatch(item):
            if tdir is None:
                raise UserError(f"--grid {source}: trace {item!r} is an openb family name: give --traces-dir "
                                "(or traces_dir in the grid file)")
            nodes, pods, label = tdir / OPENB_NODES, tdir / f"openb_pod_list_{item}.csv", item
        else:
            if shared_nodes is None:
                raise UserError(f"--grid {source}: trace {item!r} is a pod list: give its node list as 'nodes' "
                                "in the grid file (or --traces-dir)")
            nodes, pods, label = shared_nodes, _resolve(base, item), item
        for path in (nodes, pods):
            if not path.is_file():
                raise UserError(f"--grid {source}: trace {item!r}: {path} is not a file")
        out.append(TraceFiles(label=label, nodes=str(nodes), pods=str(pods)))
    labels = [t.label for t in out]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        raise UserError(f"--grid {source}: trace {dup!r} is listed twice")
    return out


def trace_sha256(trace: TraceFiles) -> str:
    digest = hashlib.sha256()
    for path in trace.paths():
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UserError(f"trace {trace.label}: cannot read {path}: {exc.strerror or exc}") from None
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def load_grid(path: Path, traces_dir: Path | None, version: str) -> Grid:
    """Every check of the grid file, and the run list, before any run starts."""
    grid = read_grid_file(path)
    policies = _policies(grid, path)
    points = _parameter_points(grid, path)
    traces = resolve_traces(grid, path, traces_dir)
    hashes = {t.label: trace_sha256(t) for t in traces}
    runs: list[RunConfig] = []
    seen: set[str] = set()
    for trace, seed, params in itertools.product(traces, grid.seeds, points):
        # the bound depends on the arrivals alone (trace, seed, ratio): one per such triple; the time mode has none
        names: Sequence[str] = [*policies, BOUND] if grid.bound and params.mode == "arrivals" else policies
        for name in names:
            p = RunParameters(ratio=params.ratio) if name == BOUND else params
            config = RunConfig(trace=trace, seed=seed, policy=name, parameters=p,
                               trace_sha256=hashes[trace.label], gpupool_version=version)
            if config.key not in seen:
                seen.add(config.key)
                runs.append(config)
    return Grid(source=path, runs=tuple(runs))

