"""How the suite spends its time: each test's wall time (setup, call and teardown: a session fixture such as the
tiny DAG counts in the first test that needs it) and how busy the machine's CPUs were meanwhile, from /proc/stat.

Written to results/suite/timing.json (schemas/suite_timing.schema.yaml) and summed up at the end of the terminal
report: the tests that left the most core-seconds idle are where running work side by side could pay, the busy ones
are where only less work can. Linux only; elsewhere nothing is recorded."""

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "suite" / "timing.json"
SCHEMA = ROOT / "schemas" / "suite_timing.schema.yaml"
SHOWN = 10  # tests named in the terminal summary

_records: list[dict] = []
_session_start: list[float] = []  # the first test's start: monotonic, then wall-clock time


def cpu_ticks(stat_line: str) -> tuple[int, int]:
    """(busy, total) clock ticks since boot from /proc/stat's first line ("cpu  user nice system idle iowait irq
    softirq steal ..."): idle and iowait are idle; guest time is already inside user and nice."""
    fields = [int(x) for x in stat_line.split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], total


def _read_ticks() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as stat:
            return cpu_ticks(stat.readline())
    except OSError:
        return None


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPUs' time that was busy between two readings (0..1; 0 when no tick passed)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def summary(records: list[dict], cpus: int) -> dict:
    """The whole run (wall seconds, busy share, idle core-seconds) and its tests, the idlest first."""
    wall = sum(r["seconds"] for r in records)
    idle = sum(r["idle_core_seconds"] for r in records)
    return {
        "cpus": cpus,
        "seconds": round(wall, 1),
        "busy_share": round(1 - idle / (wall * cpus), 3) if wall else 0.0,
        "idle_core_seconds": round(idle, 1),
        "tests": sorted(records, key=lambda r: r["idle_core_seconds"], reverse=True),
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = _read_ticks(), time.monotonic()
    _session_start[:] = _session_start or [started, time.time()]
    yield
    after, seconds = _read_ticks(), time.monotonic() - started
    if before is None or after is None:
        return
    busy = busy_share(before, after)
    cpus = os.cpu_count() or 1
    _records.append(
        {
            "test": item.nodeid,
            "e2e": item.get_closest_marker("e2e") is not None,
            "started_s": round(started - _session_start[0], 1),
            "seconds": round(seconds, 2),
            "busy_share": round(busy, 3),
            "idle_core_seconds": round(seconds * cpus * (1 - busy), 1),
        }
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _records:
        return
    from lib.stage import validate_json

    report = summary(_records, os.cpu_count() or 1)
    report["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_session_start[1]))
    validate_json(report, SCHEMA)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    write = terminalreporter.write_line
    terminalreporter.section("CPU use")
    write(
        f"{report['seconds']:.0f} s in tests, CPUs busy {report['busy_share']:.0%} of {report['cpus']}: "
        f"{report['idle_core_seconds']:.0f} idle core-seconds ({OUT.relative_to(ROOT)})"
    )
    for r in report["tests"][:SHOWN]:
        write(f"{r['idle_core_seconds']:7.0f} idle  {r['seconds']:7.1f} s  busy {r['busy_share']:4.0%}  {r['test']}")
