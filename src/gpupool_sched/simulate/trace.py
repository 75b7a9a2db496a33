"""Readers for Alibaba's cluster-trace-gpu-v2023 ("openb") node and pod lists.

Every problem is reported as ``FILE:LINE: what is wrong`` so a user can fix the file; nothing here
raises a bare traceback on bad input.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import MILLI, InvalidRequest, PodRequest

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")  # gpu_spec etc. optional
TRACE_MAX_PODS = 1001  # the FGD artifact's pods-per-node limit; a trace replay must not hit it


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Trace:
    """A cluster (GPU nodes) and the pods that arrive on it."""

    name: str
    nodes: tuple[NodeSpec, ...]
    pods: tuple[PodRequest, ...]
    warnings: tuple[str, ...] = ()  # e.g. pods that can never fit: they stay in and fail, as in the trace
    gpu_specs: Mapping[str, str] = field(default_factory=dict)  # pod -> gpu_spec as written in the file

    def spec_of(self, pod: PodRequest) -> str:
        """A pod's GPU model constraint as the trace writes it (copies resolve to their original)."""
        return self.gpu_specs.get(pod.name.split("-tuned-", 1)[0], "")

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


def bundled_path(filename: str) -> Path:
    return Path(str(resources.files("gpupool_sched.simulate") / "data" / filename))


BUNDLED_NODES = "openb_node_list_gpu_node.csv.gz"
BUNDLED_PODS = "openb_pod_list_default.csv.gz"


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise TraceError(f"{path}: not a valid gzip file ({exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise TraceError(f"{path}:1: empty file, expected a header with columns {', '.join(required)}")
    header = [h.strip() for h in header]
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceError(f"{path}:1: header lacks column(s) {', '.join(missing)} (has: {', '.join(header)})")
    for lineno, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            raise TraceError(f"{path}:{lineno}: truncated row: {len(row)} of {len(header)} fields")
        if len(row) > len(header):
            raise TraceError(f"{path}:{lineno}: {len(row)} fields, header has {len(header)}")
        yield lineno, dict(zip(header, (cell.strip() for cell in row), strict=True))


def _int(path: Path, lineno: int, row: dict[str, str], column: str, *, minimum: int = 0) -> int:
    value = row[column]
    try:
        number = int(value)
    except ValueError:
        raise TraceError(f"{path}:{lineno}: {column} must be an integer, got {value!r}") from None
    if number < minimum:
        raise TraceError(f"{path}:{lineno}: {column} must be >= {minimum}, got {number}")
    return number


def _unique_name(path: Path, lineno: int, name: str, kind: str, seen: dict[str, int]) -> str:
    if not name:
        raise TraceError(f"{path}:{lineno}: empty {kind} name")
    if name in seen:
        raise TraceError(f"{path}:{lineno}: {kind} {name} already defined on line {seen[name]}")
    seen[name] = lineno
    return name


def read_nodes(path: Path | str, *, gpu_only: bool = True) -> tuple[NodeSpec, ...]:
    """GPU nodes of a node list (CPU-only nodes are skipped unless ``gpu_only`` is false)."""
    path = Path(path)
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    for lineno, row in _rows(path, NODE_COLUMNS):
        name = _unique_name(path, lineno, row["sn"], "node", seen)
        cpu = _int(path, lineno, row, "cpu_milli", minimum=1)
        mem = _int(path, lineno, row, "memory_mib", minimum=1)
        gpus = _int(path, lineno, row, "gpu")
        model = row["model"]
        if gpus and not model:
            raise TraceError(f"{path}:{lineno}: node {name} has {gpus} GPUs but no GPU model")
        if gpus == 0 and gpu_only:
            continue
        nodes.append(
            NodeSpec(
                name=name,
                cpu_milli=cpu,
                memory_mib=mem,
                gpus=tuple(GpuSpec(index=i, model=model) for i in range(gpus)),
                max_pods=TRACE_MAX_PODS,
            )
        )
    if not nodes:
        raise TraceError(f"{path}: no {'GPU ' if gpu_only else ''}nodes in the file")
    return tuple(nodes)


def read_pods(
    path: Path | str,
    nodes: Sequence[NodeSpec],
    warnings: list[str] | None = None,
    gpu_specs: dict[str, str] | None = None,
) -> tuple[PodRequest, ...]:
    """Pod requests, each checked against the cluster: an unknown GPU model is an error naming its
    line; a pod that could not fit even on an empty node is kept (it will fail, as it did in the
    trace) and reported in ``warnings``."""
    path = Path(path)
    models = {g.model for n in nodes for g in n.gpus}
    max_cpu = max(n.cpu_milli for n in nodes)
    max_mem = max(n.memory_mib for n in nodes)
    pods: list[PodRequest] = []
    seen: dict[str, int] = {}
    fits_somewhere: dict[tuple[int, int, int, frozenset[str]], bool] = {}
    for lineno, row in _rows(path, POD_COLUMNS):
        name = _unique_name(path, lineno, row["name"], "pod", seen)
        cpu = _int(path, lineno, row, "cpu_milli")
        mem = _int(path, lineno, row, "memory_mib")
        k = _int(path, lineno, row, "num_gpu")
        milli = _int(path, lineno, row, "gpu_milli")
        raw_spec = row.get("gpu_spec", "")
        spec = frozenset(m for m in raw_spec.split("|") if m)
        if raw_spec and gpu_specs is not None:
            gpu_specs[name] = raw_spec
        unknown = sorted(spec - models)
        if unknown:
            raise TraceError(
                f"{path}:{lineno}: pod {name} asks for unknown GPU model(s) {', '.join(unknown)}"
                f" (the cluster has {', '.join(sorted(models))})"
            )
        if k == 0 and milli:
            raise TraceError(f"{path}:{lineno}: pod {name} has gpu_milli={milli} but num_gpu=0")
        if k and not 0 < milli <= MILLI:
            raise TraceError(f"{path}:{lineno}: pod {name}: gpu_milli must be 1..{MILLI} per GPU, got {milli}")
        try:
            pod = PodRequest(name=name, cpu_milli=cpu, memory_mib=mem, gpu_count=k, gpu_milli=milli, gpu_models=spec)
        except InvalidRequest as exc:
            raise TraceError(f"{path}:{lineno}: {exc}") from None
        key = (cpu, mem, k, spec)
        if key not in fits_somewhere:
            fits_somewhere[key] = any(
                n.cpu_milli >= cpu
                and n.memory_mib >= mem
                and sum(1 for g in n.gpus if not spec or g.model in spec) >= k
                for n in nodes
            )
        if not fits_somewhere[key] and warnings is not None:
            limit = f"largest node: {max_cpu} milli-CPU, {max_mem} MiB"
            warnings.append(
                f"{path}:{lineno}: pod {name} cannot fit on any node even when the cluster is empty ({limit})"
            )
        pods.append(pod)
    if not pods:
        raise TraceError(f"{path}: no pods in the file")
    return tuple(pods)


def read_trace(nodes_path: Path | str | None = None, pods_path: Path | str | None = None) -> Trace:
    """The trace named by the two files; the bundled openb default trace when they are omitted."""
    nodes_file = Path(nodes_path) if nodes_path else bundled_path(BUNDLED_NODES)
    pods_file = Path(pods_path) if pods_path else bundled_path(BUNDLED_PODS)
    nodes = read_nodes(nodes_file)
    warnings: list[str] = []
    specs: dict[str, str] = {}
    pods = read_pods(pods_file, nodes, warnings, specs)
    return Trace(name=trace_name(pods_file), nodes=nodes, pods=pods, warnings=tuple(warnings), gpu_specs=specs)


def trace_name(pods_file: Path) -> str:
    """``openb_pod_list_gpushare40.csv`` -> ``gpushare40``."""
    stem = pods_file.name.removesuffix(".gz").removesuffix(".csv")
    return stem.removeprefix("openb_pod_list_")
