"""Readers for Alibaba's cluster-trace-gpu-v2023 ("openb") node and pod lists.

Every problem is reported as ``FILE:LINE: what is wrong`` so a user can fix the file; nothing here
raises a bare traceback on bad input. Numbers are bounded here, before they reach the placement core,
so that a typo (a node with 10^23 GPUs) is an error naming its line instead of a hang or an overflow.
"""

from __future__ import annotations

import csv
import difflib
import gzip
import io
import lzma
import re
import zlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpupool_common.clihelp import decode_utf8
from gpupool_sched.model.cluster import GpuSpec, NodeSpec
from gpupool_sched.model.request import MILLI, InvalidRequest, PodRequest

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")  # gpu_spec etc. optional
TRACE_MAX_PODS = 1001  # the FGD artifact's pods-per-node limit; a trace replay must not hit it
TUNED = "-tuned-"  # marks the replay's sampled copies (`<pod>-tuned-<n>`); reserved in trace pod names

# Bounds on one row's numbers. Far above any real machine (openb: 128 cores, 1 TiB, 8 GPUs), low enough
# that the placement core's int64 arrays cannot overflow and one node cannot allocate gigabytes.
MAX_CPU_MILLI = 10**9  # a million cores
MAX_MEMORY_MIB = 1 << 40  # an exbibyte
MAX_NODE_GPUS = 1024
MAX_GPU_SLOTS = 1 << 20  # nodes x GPUs of the largest node: the size of the replay's per-GPU arrays

# GPU models a node may have: openb's (G1-G3 are Alibaba's undisclosed internal codes) and NVIDIA
# data-centre GPUs by their short names. Anything else is almost always a typo or a shifted column;
# `read_trace(extra_models=...)` (`gpupool simulate --gpu-model NAME`) accepts more.
OPENB_GPU_MODELS = ("A10", "G1", "G2", "G3", "P100", "T4", "V100M16", "V100M32")
KNOWN_GPU_MODELS = frozenset(
    (
        *OPENB_GPU_MODELS,
        *("K80", "M60", "P4", "P40", "V100", "A2", "A16", "A30", "A40", "A100", "A800"),
        *("H20", "H100", "H200", "H800", "GH200", "L4", "L20", "L40", "L40S", "B100", "B200", "GB200"),
    )
)
_INTEGER = re.compile(r"-?[0-9]+")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_COMPRESSED = {".gz": (b"\x1f\x8b", "gzip"), ".xz": (b"\xfd7zXZ\x00", "xz")}  # suffix -> (magic, name)


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
        return self.gpu_specs.get(pod.name.split(TUNED, 1)[0], "")

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


def bundled_path(filename: str) -> Path:
    return Path(str(resources.files("gpupool_sched.simulate") / "data" / filename))


BUNDLED_NODES = "openb_node_list_gpu_node.csv.gz"
BUNDLED_PODS = "openb_pod_list_default.csv.gz"


def shown(value: str, limit: int = 40) -> str:
    """A value quoted for a message, cut short: a bad cell may be megabytes long."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


def brief(name: str, limit: int = 60) -> str:
    """A name as messages print it: unquoted unless it holds a line break or another unprintable
    character (the message stays one line), cut short like :func:`shown`."""
    if not name.isprintable():
        return shown(name, limit)
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name)} characters)"


def read_text(path: Path, what: str = "") -> str:
    """A text file; ``.gz`` and ``.xz`` files are decompressed. Compressed data under another name is an
    error that says so (it would otherwise be reported as "not UTF-8")."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read{what}: {exc.strerror or exc}") from None
    if path.suffix in _COMPRESSED:
        try:
            raw = gzip.decompress(raw) if path.suffix == ".gz" else lzma.decompress(raw)
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
            raise TraceError(f"{path}: not a valid {_COMPRESSED[path.suffix][1]} file ({exc})") from None
    else:
        for suffix, (magic, name) in _COMPRESSED.items():
            if raw.startswith(magic):
                raise TraceError(
                    f"{path}: is {name}-compressed but not named {suffix}; rename it to {path.name}{suffix} "
                    "or decompress it"
                )
    text, where = decode_utf8(raw)
    if text is None:
        raise TraceError(f"{path}: not UTF-8 text at {where}; expected a CSV file")
    return text.removeprefix("\ufeff")  # as utf-8-sig: one byte-order mark


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    try:
        header = next(reader, None)
        if not header:
            raise TraceError(f"{path}:1: empty file, expected a header with columns {', '.join(required)}")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path}:1: header lacks column(s) {', '.join(missing)} (has: {shown(', '.join(header), 200)})"
            )
        doubled = sorted({h for h in header if header.count(h) > 1})
        if doubled:
            raise TraceError(f"{path}:1: header names column(s) {', '.join(doubled)} more than once")
        end = reader.line_num
        for row in reader:
            lineno, end = end + 1, reader.line_num  # a quoted cell may span lines: name the row's first
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) < len(header):
                raise TraceError(f"{path}:{lineno}: truncated row: {len(row)} of {len(header)} fields")
            if len(row) > len(header):
                raise TraceError(f"{path}:{lineno}: {len(row)} fields, header has {len(header)}")
            yield lineno, dict(zip(header, (cell.strip() for cell in row), strict=True))
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


def _int(path: Path, lineno: int, row: dict[str, str], column: str, *, minimum: int = 0, maximum: int) -> int:
    """An integer cell in ``minimum..maximum``; only ASCII digits (``int()`` would take ``1_000`` and ``١``)."""
    value = row[column]
    if not _INTEGER.fullmatch(value):
        raise TraceError(f"{path}:{lineno}: {column} must be an integer, got {shown(value)}")
    number = int(value) if len(value) <= 40 else int(value[0] + "9" * 40)  # no 4300-digit conversions
    if number < minimum:
        raise TraceError(f"{path}:{lineno}: {column} must be >= {minimum}, got {brief(value)}")
    if number > maximum:
        raise TraceError(f"{path}:{lineno}: {column} must be <= {maximum}, got {brief(value)}")
    return number


def _unique_name(path: Path, lineno: int, name: str, kind: str, seen: dict[str, int]) -> str:
    if not name:
        raise TraceError(f"{path}:{lineno}: empty {kind} name")
    if name in seen:
        raise TraceError(f"{path}:{lineno}: {kind} {brief(name)} already defined on line {seen[name]}")
    seen[name] = lineno
    return name


def _check_model(path: Path, lineno: int, name: str, model: str, known: Collection[str]) -> None:
    if model in known:
        return
    if not _MODEL_NAME.fullmatch(model):
        raise TraceError(f"{path}:{lineno}: model of node {brief(name)}: {shown(model)} is not a GPU model name")
    close = difflib.get_close_matches(model.upper(), sorted(known), n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}? " if close else ""
    raise TraceError(
        f"{path}:{lineno}: model of node {brief(name)}: unknown GPU model {model!r} ({hint}known: "
        f"{', '.join(sorted(known))}; `--gpu-model {model}` accepts it)"
    )


def read_nodes(
    path: Path | str, *, gpu_only: bool = True, extra_models: Collection[str] = ()
) -> tuple[NodeSpec, ...]:
    """GPU nodes of a node list (CPU-only nodes are skipped unless ``gpu_only`` is false).

    A GPU model outside :data:`KNOWN_GPU_MODELS` and ``extra_models`` is an error naming its line."""
    path = Path(path)
    known = KNOWN_GPU_MODELS | frozenset(extra_models)
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    widest = (0, 0)  # (GPUs, line) of the node with the most GPUs
    gpu_sets: dict[tuple[int, str], tuple[GpuSpec, ...]] = {}  # shared: GpuSpec is frozen, nodes repeat shapes
    for lineno, row in _rows(path, NODE_COLUMNS):
        name = _unique_name(path, lineno, row["sn"], "node", seen)
        cpu = _int(path, lineno, row, "cpu_milli", minimum=1, maximum=MAX_CPU_MILLI)
        mem = _int(path, lineno, row, "memory_mib", minimum=1, maximum=MAX_MEMORY_MIB)
        gpus = _int(path, lineno, row, "gpu", maximum=MAX_NODE_GPUS)
        model = row["model"]
        if gpus and not model:
            raise TraceError(f"{path}:{lineno}: node {brief(name)} has {gpus} GPUs but no GPU model")
        if gpus:
            _check_model(path, lineno, name, model, known)
        if gpus == 0 and gpu_only:
            continue
        widest = max(widest, (gpus, -lineno))
        if (len(nodes) + 1) * widest[0] > MAX_GPU_SLOTS:
            raise TraceError(
                f"{path}:{lineno}: gpu: {len(nodes) + 1} nodes, the largest with {widest[0]} GPUs (line "
                f"{-widest[1]}), exceed the simulator's {MAX_GPU_SLOTS} GPU slots (nodes x largest node's GPUs)"
            )
        nodes.append(
            NodeSpec(
                name=name,
                cpu_milli=cpu,
                memory_mib=mem,
                gpus=gpu_sets.setdefault((gpus, model), tuple(GpuSpec(index=i, model=model) for i in range(gpus))),
                max_pods=TRACE_MAX_PODS,
            )
        )
    if not nodes:
        raise TraceError(f"{path}: no {'GPU ' if gpu_only else ''}nodes in the file")
    return tuple(nodes)


def _why_unfit(pod: PodRequest, nodes: Sequence[NodeSpec]) -> str:
    """Why a pod fits on no empty node, in terms of the resource that is short."""
    spec = pod.gpu_models
    most_gpus = max(sum(1 for g in n.gpus if not spec or g.model in spec) for n in nodes)
    if pod.gpu_count > most_gpus:
        models = f" {'|'.join(sorted(spec))}" if spec else ""
        return f"it asks for {pod.gpu_count}{models} GPUs, the most on one node is {most_gpus}"
    max_cpu = max(n.cpu_milli for n in nodes)
    max_mem = max(n.memory_mib for n in nodes)
    return f"largest node: {max_cpu} milli-CPU, {max_mem} MiB"


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
    pods: list[PodRequest] = []
    seen: dict[str, int] = {}
    fits_somewhere: dict[tuple[int, int, int, frozenset[str]], bool] = {}
    for lineno, row in _rows(path, POD_COLUMNS):
        name = _unique_name(path, lineno, row["name"], "pod", seen)
        shown_name = brief(name)
        if TUNED in name:
            raise TraceError(f"{path}:{lineno}: name: pod {brief(name)}: {TUNED!r} is reserved for the replay's copies")
        cpu = _int(path, lineno, row, "cpu_milli", maximum=MAX_CPU_MILLI)
        mem = _int(path, lineno, row, "memory_mib", maximum=MAX_MEMORY_MIB)
        k = _int(path, lineno, row, "num_gpu", maximum=MAX_NODE_GPUS)
        milli = _int(path, lineno, row, "gpu_milli", maximum=MAX_CPU_MILLI)  # 1..1000 checked below, with why
        raw_spec = row.get("gpu_spec", "")
        spec = frozenset(m for m in raw_spec.split("|") if m)
        if raw_spec and gpu_specs is not None:
            gpu_specs[name] = raw_spec
        unknown = sorted(spec - models)
        if unknown:
            raise TraceError(
                f"{path}:{lineno}: pod {shown_name} asks for unknown GPU model(s) {brief(', '.join(unknown), 80)}"
                f" (the cluster has {', '.join(sorted(models))})"
            )
        if k == 0 and milli:
            raise TraceError(f"{path}:{lineno}: pod {shown_name} has gpu_milli={milli} but num_gpu=0")
        if k and not 0 < milli <= MILLI:
            raise TraceError(f"{path}:{lineno}: pod {shown_name}: gpu_milli must be 1..{MILLI} per GPU, got {milli}")
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
            warnings.append(
                f"{path}:{lineno}: pod {shown_name} cannot fit on any node even when the cluster is empty "
                f"({_why_unfit(pod, nodes)})"
            )
        pods.append(pod)
    if not pods:
        raise TraceError(f"{path}: no pods in the file")
    return tuple(pods)


def read_trace(
    nodes_path: Path | str | None = None, pods_path: Path | str | None = None, *, extra_models: Collection[str] = ()
) -> Trace:
    """The trace named by the two files; the bundled openb default trace when they are omitted."""
    nodes_file = Path(nodes_path) if nodes_path else bundled_path(BUNDLED_NODES)
    pods_file = Path(pods_path) if pods_path else bundled_path(BUNDLED_PODS)
    nodes = read_nodes(nodes_file, extra_models=extra_models)
    warnings: list[str] = []
    specs: dict[str, str] = {}
    pods = read_pods(pods_file, nodes, warnings, specs)
    if not any(p.gpu_milli_total for p in pods):
        raise TraceError(
            f"{pods_file}: no pod asks for a GPU (num_gpu is 0 on every line); the replay measures GPU "
            "allocation and samples arrivals up to a multiple of the GPU capacity"
        )
    return Trace(name=trace_name(pods_file), nodes=nodes, pods=pods, warnings=tuple(warnings), gpu_specs=specs)


def trace_name(pods_file: Path) -> str:
    """``openb_pod_list_gpushare40.csv`` (also ``.csv.gz``, ``.csv.xz``) -> ``gpushare40``."""
    stem = pods_file.name.removesuffix(".gz").removesuffix(".xz").removesuffix(".csv")
    return stem.removeprefix("openb_pod_list_")
