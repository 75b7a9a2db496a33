"""The assignment handshake's per-(node, shape) gate (docs/handshake.md, rule 4): a pod with an assignment
holds the gate of its node for its container shapes from bind until the device plugin's ack, the pod
leaving Pending, its deletion, or `gate_timeout_s`; not on nodes whose plugin tells same-shape pods apart
by the kubelet's PodResources (`needs_gate`). `gate_busy` tells the cycle which nodes are in that
pipeline for a set of shapes, so that it can prefer nodes where a bind goes out at once."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gpupool_sched.cache.entries import PodEntry, Shape
from gpupool_sched.cache.ledger import Ledger

log = logging.getLogger(__name__)


class Gates(Ledger):
    def needs_gate(self, node: str) -> bool:
        """False when the node's device plugin tells same-shape pods apart by the kubelet's PodResources
        (its inventory says `pod_identity`): several may then be pending there at once."""
        view = self.nodes.get(node)
        return not (view is not None and view.inventory is not None and view.inventory.pod_identity)

    def hold_gate(self, uid: str, shapes: Iterable[Shape]) -> None:
        entry = self.pods[uid]
        entry.shapes = frozenset(shapes)
        entry.gate_since = self.clock()
        self._occupy(entry, entry.shapes)

    def gate_busy(self, shapes: Iterable[Shape]) -> set[str]:
        """Nodes where a pod sharing one of `shapes` holds the gate or is assumed on its way to it: a
        pod placed there now would wait for that pod's ack before its Binding goes out."""
        out: set[str] = set()
        for shape in shapes:
            load = self._gate_load.get(shape)
            if load:
                out.update(load)
        return out

    def _occupy(self, entry: PodEntry, shapes: frozenset[Shape]) -> None:
        """Move `entry`'s count in the gate load from its current shapes to `shapes`."""
        for shape in entry.occupies:
            load = self._gate_load[shape]
            left = load.get(entry.node, 0) - 1
            if left > 0:
                load[entry.node] = left
            else:
                load.pop(entry.node, None)
        for shape in shapes:
            load = self._gate_load[shape]
            load[entry.node] = load.get(entry.node, 0) + 1
        entry.occupies = shapes

    def gate_blocker(self, uid: str, node: str, shapes: frozenset[Shape]) -> PodEntry | None:
        """An unacknowledged pod on `node` sharing a shape with `shapes` (then `uid` must wait)."""
        now = self.clock()
        for other_uid in self.by_node.get(node, ()):
            if other_uid == uid:
                continue
            other = self.pods[other_uid]
            if other.gate_since is None or not (other.shapes & shapes):
                continue
            if now - other.gate_since >= self.gate_timeout_s:
                log.warning("pod %s: no ack from the device plugin on %s after %.0fs; opening its gate",
                            other.key, node, now - other.gate_since)
                other.gate_since = None
                self._occupy(other, frozenset())
                self.gate_timeouts += 1
                continue
            return other
        return None

    def gate_deadline(self, blocker: PodEntry) -> float:
        return (blocker.gate_since or self.clock()) + self.gate_timeout_s - self.clock()

    def _unlink(self, uid: str) -> PodEntry | None:
        """Take the entry out of the ledger, its gate and the gate load; its accounting is the caller's."""
        entry = self.pods.pop(uid, None)
        if entry is None:
            return None
        self._tell(entry)
        self._occupy(entry, frozenset())
        uids = self.by_node.get(entry.node)
        if uids is not None:
            uids.discard(uid)
            if not uids:
                del self.by_node[entry.node]
        if entry.gate_since is not None:
            entry.gate_since = None
            self.on_gate_release(entry.node)
        return entry
