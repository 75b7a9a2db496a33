"""promtool (Debian's `prometheus` package, installed by .ci/run) checks the alert rules and runs
their unit tests: each alert firing on the series that should fire it, and staying quiet otherwise."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

FILES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpupool" / "files"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: apt-get install prometheus (.ci/run does)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", str(FILES / "gpupool-alerts.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_test_rules_covers_every_alert() -> None:
    tests = FILES / "tests" / "gpupool-alerts.test.yaml"
    done = promtool("test", "rules", str(tests))
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in yaml.safe_load((FILES / "gpupool-alerts.yaml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    cases = [c for t in yaml.safe_load(tests.read_text())["tests"] for c in t.get("alert_rule_test", ())]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert alerts <= fired, f"no firing case for {sorted(alerts - fired)}"
    assert alerts <= quiet, f"no quiet case for {sorted(alerts - quiet)}"
