"""Where a decode step's host time goes: the top-level PyTorch operators (not nested in another) of a torch-profiler
trace, per decode step, for two traces side by side (a plain step and a speculative one, or one step before and
after a change: LABEL_A/LABEL_B name the two columns, "plain" and "speculative" by default). Decode steps are vLLM's
`execute_context_0(0)_generation_*` ranges; what lies between two of them (scheduling, input preparation, sampling)
counts toward the step that follows.

    python3 gpu_proof/trace_ops.py PLAIN.json.gz SPECULATIVE.json.gz [LABEL_A LABEL_B] > ops.json
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

DECODE = "execute_context_0(0)_generation_"
LABELS = ("plain", "speculative")  # the two columns' names unless the command line gives others


def load(path: str) -> list[dict]:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as handle:
        return json.load(handle)["traceEvents"]


def top_level_ops(events: list[dict]) -> dict:
    """{"steps": decode steps, "ops": {name: [calls, microseconds]}} over the window from the first decode step to
    the last, each thread's operators counted only where no other operator of that thread encloses them."""
    decode = sorted(e["ts"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(DECODE))
    if len(decode) < 2:
        raise ValueError("fewer than two decode steps in the trace")
    start, end = decode[0], decode[-1]
    ops: dict[str, list] = defaultdict(lambda: [0, 0.0])
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and start <= e["ts"] < end:
            by_thread[(e["pid"], e["tid"])].append(e)
    for thread in by_thread.values():
        covered_until = float("-inf")
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= covered_until:
                ops[e["name"]][0] += 1
                ops[e["name"]][1] += e["dur"]
                covered_until = e["ts"] + e["dur"]
    return {"steps": len(decode) - 1, "ops": dict(ops)}


def compare(plain: dict, speculative: dict, top: int = 25, labels=LABELS) -> dict:
    """Per-step calls and milliseconds of each operator in both, the largest differences (either way) first."""

    def per_step(found, name):
        calls, us = found["ops"].get(name, (0, 0.0))
        return {"calls": round(calls / found["steps"], 1), "ms": round(us / found["steps"] / 1000, 3)}

    first, second = labels
    rows = [
        {"op": name, first: per_step(plain, name), second: per_step(speculative, name)}
        for name in set(plain["ops"]) | set(speculative["ops"])
    ]
    rows.sort(key=lambda row: abs(row[second]["ms"] - row[first]["ms"]), reverse=True)

    def total(found):
        return round(sum(us for _, us in found["ops"].values()) / found["steps"] / 1000, 3)

    return {
        "steps": {first: plain["steps"], second: speculative["steps"]},
        "top_level_ms_per_step": {first: total(plain), second: total(speculative)},
        "largest_differences": rows[:top],
    }


def main() -> None:
    plain, speculative = (top_level_ops(load(path)) for path in sys.argv[1:3])
    labels = tuple(sys.argv[3:5]) if len(sys.argv) >= 5 else LABELS
    print(json.dumps(compare(plain, speculative, labels=labels), indent=2))


if __name__ == "__main__":
    main()
