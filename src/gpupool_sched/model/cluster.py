"""The cluster as placement sees it: node specs plus what is allocated, held column-wise.

Placement policies score every node for every pod, so the allocation state lives in numpy arrays
(one row per node, one column per GPU slot) rather than in per-node objects; ``assume``/``release``
keep the arrays and a per-node version (for memos) up to date, and ``upsert_node``/``remove_node``
let a long-running scheduler follow nodes as they come and go.

The node specs are in model/node.py (imported from here too), the column storage in model/snapshot_rows.py.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpupool_sched.model.node import GpuSpec as GpuSpec
from gpupool_sched.model.node import MigSlice as MigSlice
from gpupool_sched.model.node import NodeSignature
from gpupool_sched.model.node import NodeSpec as NodeSpec
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.model.snapshot_rows import _MIN_CAPACITY, ABSENT, SnapshotRows, _counter_copy

if TYPE_CHECKING:
    from gpupool_sched.model.decision import Placement


_VERSIONS = itertools.count(1)  # row versions: one counter for every snapshot of the process


class UnknownNode(LookupError):
    """A node name the snapshot does not hold (never added, or removed)."""


class ClusterSnapshot(SnapshotRows):
    """Nodes and their allocation state. Pure data: no I/O, no clock, no Kubernetes client.

    **One writer.** ``assume``, ``release``, ``upsert_node``, ``remove_node`` and ``set_tie_order``
    mutate the snapshot; only one thread may call them, and not while another thread reads it.
    ``decide()`` never changes nodes or allocations, but it does fill ``caches`` and
    ``signature_caches`` (derived data: compiled fragmentation models, score memos, node-constraint
    masks), so ``decide()`` must not run concurrently on one snapshot from several threads either:
    give each thread its own ``copy()``.

    Rows are dense: node ``i`` is ``nodes[i]`` and row ``i`` of every array; removing a node moves
    the last row into its place. Arrays are views of buffers that grow by doubling, so re-read them
    from the snapshot after a node change instead of keeping references. ``version[i]`` changes
    whenever row ``i`` changes (allocation or node), to a number no row of any snapshot had before (copies
    keep the versions they copied): one version, one row content, so memos keyed by (row, version) stay
    sound, across copies too; a node change also clears ``caches`` and bumps ``generation``.
    """

    # ---- construction ------------------------------------------------------------------------
    def __init__(self, nodes: Sequence[NodeSpec], tie_order: Sequence[str] | None = None) -> None:
        nodes = tuple(nodes)
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            dupes = sorted(name for name, c in Counter(names).items() if c > 1)
            raise ValueError(f"duplicate node names: {', '.join(dupes[:5])}")
        for node in nodes:
            self._check_spec(node)
        super().__init__(nodes)
        self._nodes: list[NodeSpec]
        self._names: list[str]
        self.index: dict[str, int]
        self.mig_taken: list[set[str]]
        self.gpu_tags: list[Counter[str]]
        # rows whose mig_taken/gpu_tags objects are this snapshot's own; None: all are. copy() shares
        # them between both snapshots (copy-on-write: `_own_row` copies one before it is changed)
        self._own: set[int] | None = None
        self.signatures: list[NodeSignature | None] = []  # by signature id; None once no node has it
        self._signature_id: dict[NodeSignature, int] = {}
        self._signature_refs: list[int] = []
        self.tainted_nodes = 0  # nodes with a NoSchedule/NoExecute taint
        self.cordoned_nodes = 0
        self.caches: dict[object, object] = {}  # derived data keyed by its owner; cleared on node changes
        self.carried: dict[object, Callable[[Any], object]] = {}  # caches key -> its entry for a copy (`copy`)
        self.signature_caches: dict[object, object] = {}  # derived data indexed by signature id; kept
        self.generation = 0  # bumped on every node change
        self._tuples: tuple[tuple[NodeSpec, ...], tuple[str, ...]] | None = None
        self._nodes, self._names = list(nodes), names
        self.index = {name: i for i, name in enumerate(names)}
        self.mig_taken = [set() for _ in nodes]
        self.gpu_tags = [Counter() for _ in nodes]
        self._rows = len(nodes)
        self._write_rows(0, nodes)
        self._expose()
        self.version[:] = [next(_VERSIONS) for _ in nodes]
        self.set_tie_order(tie_order)

    @staticmethod
    def _check_spec(node: NodeSpec) -> None:
        for j, gpu in enumerate(node.gpus):
            if gpu.index != j:
                raise ValueError(f"node {node.name}: GPU indices must be 0..{len(node.gpus) - 1} in order")

    def _expose(self) -> None:
        """Point the public arrays at the live rows (SnapshotRows), and drop the node tuples."""
        super()._expose()
        self._tuples = None

    # ---- views -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._rows

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return self._name_tuples()[0]

    @property
    def node_names(self) -> tuple[str, ...]:
        return self._name_tuples()[1]

    def _name_tuples(self) -> tuple[tuple[NodeSpec, ...], tuple[str, ...]]:
        if self._tuples is None:
            self._tuples = (tuple(self._nodes), tuple(self._names))
        return self._tuples

    def row_of(self, name: str) -> int:
        """The row of node ``name``; :class:`UnknownNode` if the snapshot does not hold it."""
        row = self.index.get(name)
        if row is None:
            raise UnknownNode(f"node {name!r} is not in the cluster snapshot")
        return row

    @property
    def total_gpu_milli(self) -> int:
        return int(self.gpu_count.sum()) * MILLI

    def used_gpu_milli(self) -> int:
        """Allocated GPU capacity in milli-GPU (shared GPUs count fractionally; MIG slices excluded)."""
        used = np.where(self.gpu_usable, MILLI - self.free_milli, 0)
        return int(used.sum())

    def allowed_models(self, models: Iterable[str]) -> np.ndarray:
        """Boolean [nodes, slots]: GPUs whose model is in ``models`` (all GPUs when empty)."""
        models = tuple(models)
        if not models:
            return self.gpu_model != ABSENT  # type: ignore[no-any-return]
        wanted = [self._model_id[m] for m in models if m in self._model_id]
        return np.isin(self.gpu_model, wanted)

    def set_tie_order(self, order: Sequence[str] | None) -> None:
        """Equal scores go to the node whose key in ``order`` (one per node, in row order) sorts first,
        equal keys by name; by default the key is the node name. Nodes added later use their key in the
        last ``order`` if it named them, else their name."""
        keys = list(order) if order is not None else list(self._names)
        if len(keys) != len(self):
            raise ValueError(f"tie order has {len(keys)} entries for {len(self)} nodes")
        self._tie_key_of: dict[str, str] = dict(zip(self._names, keys, strict=True)) if order is not None else {}
        self._tie_sorted = sorted(zip(keys, self._names, strict=True))
        rank = {name: r for r, (_, name) in enumerate(self._tie_sorted)}
        self.tie_rank[:] = [rank[name] for name in self._names]

    def copy(self) -> ClusterSnapshot:
        """An independent snapshot with the same nodes and allocation. The per-node MIG sets and tag
        Counters are shared until either snapshot changes a row (`_own_row`). Its caches are empty but for
        the entries whose key is in ``carried``: each one's function gives the copy's entry (the same
        object for data of the node set only, copies of what either snapshot changes in place)."""
        other = object.__new__(ClusterSnapshot)
        other.__dict__.update(self.__dict__)
        other._buf = {key: buf.copy() for key, buf in self._buf.items()}
        other._nodes, other._names, other.index = list(self._nodes), list(self._names), dict(self.index)
        other.mig_taken, other.gpu_tags = list(self.mig_taken), list(self.gpu_tags)
        self._own, other._own = set(), set()  # shared now: each copies a row's set/Counter before a change
        other.models, other._model_id = list(self.models), dict(self._model_id)
        other.mig_profiles, other._mig_model_keys = list(self.mig_profiles), list(self._mig_model_keys)
        other.signatures, other._signature_id = list(self.signatures), dict(self._signature_id)
        other._signature_refs = list(self._signature_refs)
        other._tie_key_of, other._tie_sorted = dict(self._tie_key_of), list(self._tie_sorted)
        other.caches = {key: carry(entry) for key, entry in self.caches.items()
                        if (carry := self.carried.get(key)) is not None}
        other.carried, other.signature_caches = dict(self.carried), {}
        other._expose()
        return other

    # ---- node changes ------------------------------------------------------------------------
    def upsert_node(self, spec: NodeSpec) -> None:
        """Add a node, or replace the spec of the node of that name and reset ITS allocation to empty
        (the caller re-assumes the pods it knows there). Other nodes' rows are not touched."""
        self._check_spec(spec)
        version = next(_VERSIONS)
        row = self.index.get(spec.name)
        if row is None:
            row = self._append_row(spec)
            self._expose()
            self._insert_tie(row)
        else:
            self._forget_signature(row)
            self._nodes[row] = spec
            self.mig_taken[row], self.gpu_tags[row] = set(), Counter()
            if self._own is not None:
                self._own.add(row)
            self._make_room(spec)
            keep = self._buf["version"][row], self._buf["tie_rank"][row]
            self._clear_row(row)
            self._buf["version"][row], self._buf["tie_rank"][row] = keep
            self._write_rows(row, [spec])
            self._expose()
        self.version[row] = version
        self._node_set_changed()

    def remove_node(self, name: str) -> None:
        """Drop node ``name`` and its allocation; the last row moves into its place."""
        row = self.row_of(name)
        version = next(_VERSIONS)
        self._remove_tie(row)
        self._forget_signature(row)
        last = self._rows - 1
        per_node: tuple[list[Any], ...] = (self._nodes, self._names, self.mig_taken, self.gpu_tags)
        if row != last:
            for buf in self._buf.values():
                buf[row] = buf[last]
            for items in per_node:
                items[row] = items[last]
            if self._own is not None:
                if last in self._own:
                    self._own.add(row)
                else:
                    self._own.discard(row)
            self.index[self._names[row]] = row
            self._buf["version"][row] = version
        self._clear_row(last)
        for items in per_node:
            items.pop()
        if self._own is not None:
            self._own.discard(last)
        del self.index[name]
        self._rows -= 1
        self._expose()
        self._node_set_changed()

    def _node_set_changed(self) -> None:
        self.caches.clear()
        self.generation += 1
        self._tuples = None

    def _append_row(self, spec: NodeSpec) -> int:
        row = self._rows
        if row >= self._capacity:
            self._grow(max(2 * self._capacity, _MIN_CAPACITY), self.gpu_slots)
        self._rows += 1
        self._nodes.append(spec)
        self._names.append(spec.name)
        self.index[spec.name] = row
        self.mig_taken.append(set())
        self.gpu_tags.append(Counter())
        if self._own is not None:
            self._own.add(row)
        self._make_room(spec)
        self._write_rows(row, [spec])
        return row

    def _write_rows(self, start: int, specs: Sequence[NodeSpec]) -> None:
        """Write the rows (SnapshotRows) and count each one's node signature."""
        super()._write_rows(start, specs)
        for k, spec in enumerate(specs):
            self._remember_signature(start + k, spec)

    def _remember_signature(self, row: int, spec: NodeSpec) -> None:
        sig = NodeSignature.of(spec)
        sid = self._signature_id.setdefault(sig, len(self.signatures))
        if sid == len(self.signatures):  # new; ids are never reused, so per-signature caches stay valid
            self.signatures.append(sig)
            self._signature_refs.append(0)
        else:
            sig = self.signatures[sid]  # type: ignore[assignment]
        self._signature_refs[sid] += 1
        self._buf["node_signature"][row] = sid
        self.tainted_nodes += sig.hard_tainted
        self.cordoned_nodes += sig.unschedulable

    def _forget_signature(self, row: int) -> None:
        sid = int(self._buf["node_signature"][row])
        sig = self.signatures[sid]
        assert sig is not None
        self.tainted_nodes -= sig.hard_tainted
        self.cordoned_nodes -= sig.unschedulable
        self._signature_refs[sid] -= 1
        if not self._signature_refs[sid]:
            del self._signature_id[sig]
            self.signatures[sid] = None

    def _insert_tie(self, row: int) -> None:
        name = self._names[row]
        entry = (self._tie_key_of.get(name, name), name)
        pos = bisect.bisect_left(self._tie_sorted, entry)
        self._tie_sorted.insert(pos, entry)
        self.tie_rank[self.tie_rank >= pos] += 1
        self.tie_rank[row] = pos

    def _remove_tie(self, row: int) -> None:
        pos = int(self.tie_rank[row])
        del self._tie_sorted[pos]
        self.tie_rank[self.tie_rank > pos] -= 1

    # ---- allocation --------------------------------------------------------------------------
    def assume(self, request: PodRequest, placement: Placement) -> None:
        """Account ``request`` (every GPU shape of it) on the node and GPUs of ``placement``."""
        self._apply(request, placement, +1)

    def fits(self, request: PodRequest, placement: Placement) -> bool:
        """``placement`` (exact devices) can take ``request`` now: nothing it uses would be overcommitted."""
        row = self.index.get(placement.node)
        if row is None:
            return False
        parts = placement.parts()
        if any(u in self.mig_taken[row] for part in parts for u in part.mig_devices):
            return False
        try:
            self.assume(request, placement)
        except ValueError:
            return False
        try:
            gpus = [j for part in parts for j in part.gpu_indices]
            return bool(all(self.gpu_usable[row, j] and self.free_milli[row, j] >= 0
                            and self.gpu_mem_free[row, j] >= 0 for j in gpus)
                        and self.cpu_free[row] >= 0 and self.mem_free[row] >= 0 and self.pods_free[row] >= 0
                        and all(free[row] >= 0 for free in self.mig_free.values()))
        finally:
            self.release(request, placement)

    def release(self, request: PodRequest, placement: Placement) -> None:
        """Undo :meth:`assume` exactly (a pod finished, was preempted, or a bind failed)."""
        self._apply(request, placement, -1)

    def _apply(self, request: PodRequest, placement: Placement, sign: int) -> None:
        i = self.row_of(placement.node)
        self._check_placement(i, request, placement)
        self.cpu_free[i] -= sign * request.cpu_milli
        self.mem_free[i] -= sign * request.memory_mib
        self.pods_free[i] -= sign
        for part in placement.parts():
            self._apply_gpus(i, part, sign)
        tag = request.gpu_tag()
        if tag != "cpu":
            self._own_row(i)
            self.gpu_tags[i][tag] += sign
            if self.gpu_tags[i][tag] <= 0:
                del self.gpu_tags[i][tag]
        self.version[i] = next(_VERSIONS)

    def _own_row(self, i: int) -> None:
        """Make row ``i``'s MIG set and tag Counter this snapshot's own (copy-on-write after copy())."""
        own = self._own
        if own is not None and i not in own:
            self.mig_taken[i] = set(self.mig_taken[i])
            self.gpu_tags[i] = _counter_copy(self.gpu_tags[i])
            own.add(i)

    def _check_placement(self, i: int, request: PodRequest, placement: Placement) -> None:
        """Reject a placement that does not fit this node before anything is changed."""
        if not placement.extras and not request.extra and not placement.mig_devices:  # the common case, fast
            count = len(self._nodes[i].gpus)
            for j in placement.gpu_indices:
                if not 0 <= j < count:
                    raise ValueError(f"pod {request.name}: node {placement.node} has no GPU {j}")
            return
        if len(placement.extras) != len(request.extra):
            raise ValueError(
                f"pod {request.name}: placement has {len(placement.extras)} extra part(s) for "
                f"{len(request.extra)} extra GPU shape(s)"
            )
        node = self._nodes[i]
        for part in placement.extras:
            if part.node != placement.node:
                raise ValueError(f"pod {request.name}: extra part on {part.node}, primary on {placement.node}")
        for part in placement.parts():
            bad = [j for j in part.gpu_indices if not 0 <= j < len(node.gpus)]
            if bad:
                raise ValueError(f"pod {request.name}: node {node.name} has no GPU {bad[0]}")
            if part.mig_devices:
                uuids = {s.uuid for g in node.gpus for s in g.mig_slices}
                unknown = [u for u in part.mig_devices if u not in uuids]
                if unknown:
                    raise ValueError(f"pod {request.name}: node {node.name} has no MIG device {unknown[0]}")

    def _apply_gpus(self, i: int, part: Placement, sign: int) -> None:
        whole = part.gpu_milli == MILLI  # a whole GPU takes its own memory, whatever its size
        for j in part.gpu_indices:
            self.free_milli[i, j] -= sign * part.gpu_milli
            self.gpu_mem_free[i, j] -= sign * (self.gpu_mem_total[i, j] if whole else part.gpu_memory_mib)
        if part.mig_devices:
            self._own_row(i)
            slices = {s.uuid: (s.profile, g) for g in self._nodes[i].gpus for s in g.mig_slices}
            for uuid in part.mig_devices:
                profile, gpu = slices[uuid]
                if sign > 0:
                    self.mig_taken[i].add(uuid)
                else:
                    self.mig_taken[i].discard(uuid)
                if gpu.healthy:  # an unhealthy GPU's slices are not counted as offered at all
                    self.mig_free[profile][i] -= sign
                    self.mig_free_by_model[(profile, gpu.model)][i] -= sign
