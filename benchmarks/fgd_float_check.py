"""Why our FGD differs from the paper on a few published runs: replay them with FGD computed the
artifact's way (float64, summed per "fragment type" bucket in class order) next to ours (exact
integers). Where the two differ, the float version lands on the paper's number.

    python -m benchmarks.fgd_float_check cpu250:43 gpushare80:50 gpuspec33:48
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.openb import DEFAULT_TRACES, load, paper_values
from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.placement.fgd import GPU_CHOICE, FgdScore, whole_gpu_after
from gpupool_sched.placement.filters import default_filters
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.framework import CycleState, Policy
from gpupool_sched.placement.gpu_selection import ScorerChoice, TightestFit
from gpupool_sched.simulate.metrics import allocation_curve
from gpupool_sched.simulate.replay import replay
from gpupool_sched.simulate.run import prepare_workload

Q1, Q2, Q3, Q4, XL, XR, NA = range(7)  # the artifact's fragment types, in its summation order


class FloatBucketFgd(FgdScore):
    """FGD whose node fragmentation is accumulated exactly as the artifact's Go code does it."""

    name = "FGD-float"

    def __init__(self, profile: WorkloadProfile, all_pods: int) -> None:
        super().__init__(profile)
        total, covered = float(all_pods), float(profile.total)
        self.freq = [(c.count / total) / (covered / total) for c in profile.classes]

    def _frag(self, snap: ClusterSnapshot, free: np.ndarray, cpu: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        idle = np.clip(free, 0, None)
        total = idle.sum(axis=-1).astype(np.float64)
        data = [np.zeros(total.shape) for _ in range(7)]
        for c, f in zip(self.profile.classes, self.freq, strict=True):
            if c.gpu_milli == 0:
                ok = cpu >= c.cpu_milli
                data[XL] = np.where(ok, data[XL] + f * total, data[XL])
                data[XR] = np.where(ok, data[XR], data[XR] + f * total)
                continue
            access = np.any(snap.allowed_models(c.models), axis=1)[nodes] if c.models else np.ones(len(nodes), bool)
            if free.ndim == 3:
                access = access[:, None]
            fits = (free >= c.gpu_milli).sum(axis=-1) >= c.gpu_count
            cpu_ok = cpu >= c.cpu_milli
            frag = np.where(free < c.gpu_milli, idle, 0).sum(axis=-1).astype(np.float64)
            kind = np.where(~access, NA, np.where(fits, np.where(cpu_ok, Q3, Q4), np.where(cpu_ok, Q2, Q1)))
            q3 = kind == Q3
            data[Q2] = np.where(q3, data[Q2] + f * frag, data[Q2])
            data[Q3] = np.where(q3, data[Q3] + f * (total - frag), data[Q3])
            for b in (Q1, Q2, Q4, NA):
                data[b] = np.where(kind == b, data[b] + f * total, data[b])
        out = np.zeros(total.shape)
        for b in range(7):
            if b != Q3:
                out = out + data[b]
        return out

    def score(self, state: CycleState, candidates: np.ndarray) -> np.ndarray:
        snap, req = state.snapshot, state.request
        free, cpu = snap.free_milli[candidates], snap.cpu_free[candidates]
        before = self._frag(snap, free, cpu, candidates)
        cpu_after = cpu - req.cpu_milli

        def sig(x: np.ndarray) -> np.ndarray:
            return np.floor((1.0 / (1.0 + np.exp(-x))) * 100.0)

        if req.is_shared:
            slots = free.shape[1]
            after_free = np.repeat(free[:, None, :], slots, axis=1)
            after_free[:, np.arange(slots), np.arange(slots)] -= req.gpu_milli
            s = sig((before[:, None] - self._frag(snap, after_free, cpu_after[:, None], candidates)) / 1000)
            s = np.where(state.eligible[candidates], s, -1.0)
            best = np.argmax(s, axis=1)
            state.scratch[GPU_CHOICE] = (candidates, best)
            return s[np.arange(len(candidates)), best]
        after_free = whole_gpu_after(state, candidates) if req.wants_gpu else free
        return sig((before - self._frag(snap, after_free, cpu_after, candidates)) / 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="TRACE:SEED")
    args = ap.parse_args(argv)
    paper = paper_values()
    for spec in args.runs:
        trace, _, seed_text = spec.partition(":")
        seed = int(seed_text)
        t = load(trace)
        workload = prepare_workload(
            t, seed, DEFAULT_TRACES / "sim_event_order" / f"openb_pod_list_{trace}.order.csv.gz"
        )
        out = {}
        for label, scorer in (
            ("exact", FgdScore(workload.profile)),
            ("float", FloatBucketFgd(workload.profile, len(t.pods))),
        ):
            policy = Policy(label, default_filters(), ((scorer, 1.0),), ScorerChoice(GPU_CHOICE, TightestFit()))
            r = replay(t.nodes, workload.arrivals, policy, workload.profile, tie_order=workload.tie_order)
            out[label] = allocation_curve(r.arrived_milli, r.used_milli, r.total_gpus)[100]
        print(
            f"{trace} seed {seed}: paper {paper[(trace, 'FGD', seed)][0]:.2f}  "
            f"ours (exact) {out['exact']:.2f}  artifact arithmetic {out['float']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
