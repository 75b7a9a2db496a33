"""The lower bound on a real trace: below what every policy leaves unallocated, non-negative, deterministic."""

from __future__ import annotations

import pytest

from gpupool_sched.placement.registry import POLICIES, build_policy
from gpupool_sched.simulate.bound import lower_bound
from gpupool_sched.simulate.bound_instance import measured_prefix
from gpupool_sched.simulate.replay import replay
from gpupool_sched.simulate.report import build_report
from gpupool_sched.simulate.run import bound_report, prepare_workload
from gpupool_sched.simulate.trace import read_trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run():
    trace = read_trace()  # the bundled openb default trace
    workload = prepare_workload(trace, 43)
    n = measured_prefix(workload.arrivals, trace.total_gpus)
    return trace, workload, n, lower_bound(trace.nodes, workload.arrivals[:n])


@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_policy_allocates_more_than_the_bound_allows(default_run, policy):
    trace, workload, n, bound = default_run
    result = replay(trace.nodes, workload.arrivals, build_policy(policy, workload.profile), workload.profile,
                    seed=workload.seed)
    # exact, in milli, at the last event the 100% point averages (allocation only grows up to it)
    assert result.used_milli[n] <= bound.max_allocated_milli
    assert bound.capacity_milli == trace.total_gpus * 1000
    # and as the table prints them: the report's rounding can take its figure down by at most 0.01
    report = build_report(result, trace.name, workload.seed, None)
    assert report.final.arrived_pct == 100.0
    assert bound.unallocated_pct <= report.final.unallocated_pct + 0.01


def test_the_bound_is_positive_and_deterministic(default_run):
    trace, workload, n, bound = default_run
    assert 0 < bound.unallocated_milli < trace.total_gpus * 1000 // 10  # a few % of the cluster, not 0
    assert bound.pattern.converged
    again = bound_report(trace, workload)
    assert again.max_allocated_milli == bound.max_allocated_milli and again.pods == n
    assert bound_report(trace, workload).model_dump(exclude={"seconds"}) == again.model_dump(exclude={"seconds"})
