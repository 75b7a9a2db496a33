"""Issue 18 (job-centric framework) must not change a single decision: each scenario of
`decision_record.SCENARIOS` (lone pods, gangs, preemption, quota reclaim) runs through the real
`SchedulerService` and its record (bindings with their devices, Unschedulable messages, evictions and
for whom, nominations, Events, where each pod waits) must equal the one recorded with the code before
the redesign (tests/data/decisions; tests/support/record_decisions.py says how and at which commit).
A mismatch shows the first decision that differs, recorded and now."""

from __future__ import annotations

import json

import pytest

from tests.support.decision_record import SCENARIOS, first_difference, path_of, run_scenario


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_decisions_equal_the_recording(name: str) -> None:
    recorded = json.loads(path_of(name).read_text())
    difference = first_difference(recorded, run_scenario(SCENARIOS[name]))
    if difference is not None:
        pytest.fail(difference, pytrace=False)


def test_a_changed_decision_is_reported_with_both_records() -> None:
    recorded = json.loads(path_of("gangs").read_text())
    changed = json.loads(json.dumps(recorded))
    changed.pop("recorded_at", None)
    binding = next(w for e in changed["entries"] for w in e.get("writes", ()) if w["kind"] == "bind")
    was, binding["node"] = binding["node"], "elsewhere"
    report = first_difference(recorded, changed)
    assert report is not None, "a changed binding went unnoticed"
    lines = [line.replace(" ", "") for line in report.splitlines()]
    assert f'-"node":"{was}",' in lines and '+"node":"elsewhere",' in lines, report
    assert first_difference(recorded, {k: v for k, v in recorded.items() if k != "recorded_at"}) is None
