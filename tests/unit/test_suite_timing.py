"""tests/suite_timing.py's arithmetic: /proc/stat's ticks, the busy share and the summary the suite writes."""

from pathlib import Path

import pytest

from lib.stage import validate_json
from suite_timing import SCHEMA, busy_share, cpu_ticks, summary


def test_idle_and_iowait_are_idle_and_steal_is_busy():
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert cpu_ticks("cpu  100 5 20 800 50 3 2 20 7 0") == (150, 1000)


def test_busy_share_between_two_readings():
    assert busy_share((150, 1000), (300, 1200)) == pytest.approx(0.75)
    assert busy_share((150, 1000), (150, 1000)) == 0.0  # no tick between them


def test_summary_adds_up_and_puts_the_idlest_first():
    records = [
        {"test": "a", "e2e": False, "started_s": 0.0, "seconds": 10.0, "busy_share": 1.0, "idle_core_seconds": 0.0},
        {"test": "b", "e2e": True, "started_s": 10.0, "seconds": 30.0, "busy_share": 0.5, "idle_core_seconds": 30.0},
    ]
    report = summary(records, cpus=2)
    validate_json(report, Path(SCHEMA))
    assert [r["test"] for r in report["tests"]] == ["b", "a"]
    assert report["seconds"] == 40.0 and report["idle_core_seconds"] == 30.0
    assert report["busy_share"] == pytest.approx(1 - 30 / 80)
    assert summary([], cpus=2)["busy_share"] == 0.0
