"""Prometheus config and alert rules: promtool's checks and the unit tests in rules_test.yml.

promtool comes from Debian's `prometheus` package (CI installs it); the tests skip where it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM_DIR = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found (apt-get install prometheus)")


def promtool(*args: str) -> None:
    proc = subprocess.run([PROMTOOL, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_config() -> None:
    promtool("check", "config", "prometheus.yml")


def test_check_rules() -> None:
    promtool("check", "rules", "rules.yml")


def test_rule_unit_tests() -> None:
    promtool("test", "rules", "rules_test.yml")


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert alerts, "no alerts in rules.yml"
    assert alerts - fires == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a not-firing test"
