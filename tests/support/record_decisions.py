"""Record the scheduling decisions of every scenario in `decision_record.SCENARIOS` into
tests/data/decisions/<scenario>.json, which test_recorded_decisions.py compares the current code against.

Record with the code whose behaviour is the reference, never with the code under test. The files in
tests/data/decisions were recorded at commit 7727648 (main before the issue 18 redesign) with:

    cd /work/main && git worktree add -f /tmp/oldmain 7727648
    PYTHONPATH=/tmp/oldmain/src .venv/bin/python tests/support/record_decisions.py
    git worktree remove --force /tmp/oldmain

The scenario driver is taken from this checkout (its root put first on sys.path below); the scheduler
(`gpupool_sched`) from PYTHONPATH, i.e. the worktree of the reference commit. Each file says which
commit it was recorded at (`recorded_at`: the commit of the checkout `gpupool_sched` was imported from).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: `tests.support` is imported from it


def commit_of(path: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no", "--", "src"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" (modified)" if dirty else "")


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import gpupool_sched
    from tests.support.decision_record import SCENARIOS, path_of, run_scenario, write_record

    source = Path(gpupool_sched.__file__).resolve().parent
    commit = commit_of(source)
    print(f"recording with {source} at {commit}")
    for name, scenario in SCENARIOS.items():
        record = {**run_scenario(scenario), "recorded_at": commit}
        write_record(record, path_of(name))
        print(f"{name}: {record['decisions']} decisions -> {path_of(name)}")


if __name__ == "__main__":
    main()
