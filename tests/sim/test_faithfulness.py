"""The simulator reproduces the FGD paper's published runs, and gpupool beats FGD on them.

Reads ../shared/traces/openb (the published event orders and per-seed results); skipped when absent.
"""

from __future__ import annotations

import pytest

from benchmarks.openb import DEFAULT_TRACES, PAPER_LABEL, paper_values, replay_published

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_TRACES / "paper_alloc.csv").exists(), reason="../shared/traces/openb not present"),
]
TOLERANCE = 0.2  # percentage points of cluster GPU capacity
CASES = [("default", seed) for seed in range(42, 52)] + [
    ("gpushare40", 42), ("multigpu20", 43), ("gpuspec25", 44), ("cpu050", 45),
]  # fmt: skip


@pytest.fixture(scope="module")
def paper():
    return paper_values()


@pytest.mark.parametrize("policy", ["fgd", "best-fit"])
@pytest.mark.parametrize(("trace", "seed"), CASES)
def test_published_allocation_is_reproduced(paper, trace, seed, policy):
    run = replay_published(trace, policy, seed)
    expected_100, expected_130 = paper[(trace, PAPER_LABEL[policy], seed)]
    assert abs(run.alloc_at_100 - expected_100) <= TOLERANCE, (run.alloc_at_100, expected_100)
    assert abs(run.alloc_at_130 - expected_130) <= TOLERANCE, (run.alloc_at_130, expected_130)


@pytest.mark.parametrize(
    ("trace", "seed"), [("default", 42), ("gpushare40", 43), ("multigpu20", 44), ("gpuspec33", 45)]
)
def test_gpupool_leaves_fewer_gpus_unallocated_than_fgd(trace, seed):
    fgd = replay_published(trace, "fgd", seed)
    ours = replay_published(trace, "gpupool", seed)
    assert 100 - ours.alloc_at_100 < 100 - fgd.alloc_at_100, (ours.alloc_at_100, fgd.alloc_at_100)
