"""What the GpuQuotas' teams hold (framework/plugins/quotas.py): the valid quotas resolved against the
namespaces' labels, and each one's usage kept up to date from ClusterState's ledger as it changes (a
check costs O(quotas), not O(pods)), verified now and then by a full recount. `QuotaLedger` is the base
of `QuotaBook`, which adds the watch events, the cycle's questions and the status it publishes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gpupool_sched.cache.entries import Phase, PodEntry
from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.quota_spec import _Record
from gpupool_sched.placement.quota import Amount, Cohort, Quota, held_by, owners, total
from gpupool_sched.placement.quota import usage as count_usage

log = logging.getLogger(__name__)

# every entry: a NOMINATED hold counts against its preemptor's team (what it reclaimed stays its own: issue 16 A5)
_COUNTED = frozenset((Phase.ASSUMED, Phase.BOUND, Phase.CONFIRMED, Phase.NOMINATED))


@dataclass(frozen=True, slots=True)
class _Held:
    namespace: str  # whose quota it counts against
    amount: Amount


class QuotaLedger:
    """The GpuQuota records and namespaces given to the book, resolved, and what each quota's namespaces
    hold. Runs on the scheduler's event loop thread."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.records: dict[str, _Record] = {}
        self.namespaces: dict[str, dict[str, str]] = {}  # name -> labels
        self._resolved: list[Quota] | None = None
        self._governing: dict[str, str] = {}  # namespace -> the quota that governs it (with _resolved)
        self._used: dict[str, Amount] = {}  # valid quota -> what its namespaces hold (with _resolved)
        self._cohort = Cohort({}, Amount(), Amount())  # admit()'s sums and owners (with _resolved, _used)
        self._by_name: dict[str, Quota] = {}  # the valid quotas (with _resolved)
        self._held: dict[str, _Held] = {}  # ledger UID -> what it counts (entries holding nothing: absent)
        self._by_namespace: dict[str, Amount] = {}  # namespace -> what its entries hold
        self.on_freed: Callable[[str | None], object] = lambda quota: None  # see _recount
        self.recounts = 0  # verify() calls; drift repaired by them is logged
        state.watchers.append(self._recount)
        for entry in list(state.pods.values()):
            self._recount(entry)

    # ---- what the core is given -----------------------------------------------------------------
    def quotas(self) -> list[Quota]:
        """The valid quotas, their selectors resolved to today's namespaces, by name."""
        if self._resolved is None:
            out = []
            for record in sorted(self.records.values(), key=lambda r: r.name):
                if record.spec is None:
                    continue
                selector = record.spec.selector
                chosen = frozenset(ns for ns, labels in self.namespaces.items() if selector.matches(labels))
                out.append(Quota(record.name, chosen, record.spec.guaranteed, record.spec.borrowing_limit))
            self._resolved = out
            self._governing = owners(out)
            used = {q.name: Amount() for q in out}
            for namespace, amount in self._by_namespace.items():
                name = self._governing.get(namespace)
                if name is not None:
                    used[name] += amount
            self._used = used
            self._by_name = by_name = {q.name: q for q in out}
            self._cohort = Cohort({ns: by_name[name] for ns, name in self._governing.items()},
                                  total(q.guaranteed for q in out), total(used.values()))
        return self._resolved

    def usage(self) -> dict[str, Amount]:
        """What each valid quota's namespaces hold now (assumed, bound, confirmed), kept up to date as the
        ledger changes (`_recount`): O(quotas), not a scan of the ledger."""
        self.quotas()
        return dict(self._used)

    def recount(self) -> dict[str, Amount]:
        """`usage()` counted afresh from the whole ledger, O(pods): the reference the incremental count
        is tested and checked (`verify`) against."""
        unit = self.state.memory_unit_mib
        return count_usage(self.quotas(), ((self._namespace_of(e), held_by(e.placement, unit))
                                           for e in self.state.pods.values() if e.phase in _COUNTED))

    def verify(self) -> bool:
        """Recount the whole ledger; a difference from the incremental usage (a ledger change that bypassed
        ClusterState's watchers) is logged and repaired. True when there was none."""
        self.recounts += 1
        expected = self.recount()
        if expected == self.usage():
            return True
        log.warning("GpuQuota usage drifted from the ledger (kept %s, counted %s); repaired", self.usage(), expected)
        self._held.clear()
        self._by_namespace.clear()
        self._resolved = None
        for entry in list(self.state.pods.values()):
            self._recount(entry)
        self.quotas()
        return False

    def _recount(self, entry: PodEntry) -> None:
        """ClusterState's watcher: `entry` joined or left the ledger, or what it holds changed. Moves its
        amount between the namespace and quota totals; a quota whose usage dropped is told to `on_freed`
        (then None: the cohort has more room to lend)."""
        uid = entry.uid
        old = self._held.pop(uid, None)
        new: _Held | None = None
        if self.state.pods.get(uid) is entry and entry.phase in _COUNTED:
            amount = held_by(entry.placement, self.state.memory_unit_mib)
            if not amount.is_zero:
                new = self._held[uid] = _Held(self._namespace_of(entry), amount)
        if old == new:
            return
        self.quotas()  # _governing and _used current
        touched = {name for h in (old, new) if h is not None and (name := self._governing.get(h.namespace))}
        before = {name: self._used[name] for name in touched}
        cohort_used = before_cohort = self._cohort.used
        if old is not None:
            self._by_namespace[old.namespace] = self._by_namespace.get(old.namespace, Amount()) - old.amount
            if (name := self._governing.get(old.namespace)) is not None:
                self._used[name] -= old.amount
                cohort_used -= old.amount
        if new is not None:
            self._by_namespace[new.namespace] = self._by_namespace.get(new.namespace, Amount()) + new.amount
            if (name := self._governing.get(new.namespace)) is not None:
                self._used[name] += new.amount
                cohort_used += new.amount
        if touched:
            self._cohort = replace(self._cohort, used=cohort_used)
        freed = sorted(name for name in touched if not before[name].within(self._used[name]))
        for name in freed:
            self.on_freed(name)
        if freed and not before_cohort.within(self._cohort.used):  # not e.g. a victim's GPUs turned into a hold
            self.on_freed(None)

    def _namespace_of(self, entry: PodEntry) -> str:
        """The namespace whose quota a ledger entry counts against: its pod's, or for a hold (what a gone
        victim freed, kept for a preemptor) its preemptor's."""
        if entry.phase is not Phase.NOMINATED:
            return entry.key.partition("/")[0]
        nomination = self.state.nominations.get(entry.uid.split("/")[1] if entry.uid.startswith("hold/") else "")
        if nomination is not None:
            return nomination.key.partition("/")[0]
        return entry.key.removeprefix("hold for ").partition("/")[0]

    def _own_holds(self, preemptors: Iterable[str]) -> Amount:
        """What the holds kept for these pods count (against their own team): not counted against
        themselves when they are checked, as they take that room when placed."""
        out = Amount()
        for uid in preemptors:
            nomination = self.state.nominations.get(uid)
            for hold in nomination.holds if nomination is not None else ():
                held = self._held.get(hold)
                if held is not None:
                    out += held.amount
        return out
