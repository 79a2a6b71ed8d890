"""Where the engine core's host time goes, from py-spy's raw output (`py-spy record --format raw --threads`).

The torch profiler sees PyTorch operators and roughly doubles the host time it measures; py-spy samples the Python
stacks of a running process from outside at a fixed rate, so a function's share of one thread's samples is its
share of that thread's time. Sampled with `--idle` (wall clock) the main thread has a sample at every tick, and a
share times the measured step time is milliseconds a step; sampled without it, the shares are of on-CPU time.

A raw line is `thread (TID): NAME;frame;frame;... COUNT`, root first, each frame `function (file.py:line)`.

    python3 gpu_proof/spy_breakdown.py RAW.txt[.gz] [--step-ms 4.7] [--anchor "step_with_batch_queue (core.py)"]
"""

import argparse
import gzip
import json
import re
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^thread \((?P<tid>[^)]*)\): (?P<stack>.*) (?P<count>\d+)$")
FRAME_LINE = re.compile(r":\d+\)$")
# the engine core's busy loop: one pass schedules, executes and samples one step (async scheduling: one queued)
ENGINE_LOOP = "run_busy_loop (core.py)"


def read_raw(path: Path) -> str:
    return (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode()


def function_of(frame: str) -> str:
    """`execute_model (gpu_model_runner.py:4111)` -> `execute_model (gpu_model_runner.py)`: one entry per function."""
    return FRAME_LINE.sub(")", frame)


def parse(text: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(thread label `NAME (TID)`, frames root first without line numbers, samples) per line."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = LINE.match(line)
        if not match:
            raise ValueError(f"line {number} is not py-spy raw output: {line[:120]!r}")
        name, *frames = match["stack"].split(";")
        samples.append((f"{name} ({match['tid']})", tuple(function_of(f) for f in frames), int(match["count"])))
    if not samples:
        raise ValueError("no samples: py-spy wrote nothing (was the process idle, or not Python?)")
    return samples


def thread_totals(samples) -> dict[str, int]:
    totals = Counter()
    for thread, _, count in samples:
        totals[thread] += count
    return dict(totals.most_common())


def main_thread(samples, loop: str = ENGINE_LOOP) -> str:
    """The thread that runs the engine loop (most samples inside `loop`)."""
    inside = Counter()
    for thread, frames, count in samples:
        if loop in frames:
            inside[thread] += count
    if not inside:
        raise ValueError(f"no thread runs {loop}: not an engine core's stacks")
    return inside.most_common(1)[0][0]


def _entries(counts: Counter, total: int, step_ms: float | None, top: int) -> list[dict]:
    rows = []
    for name, count in counts.most_common(top):
        share = count / total
        row = {"function": name, "samples": count, "share": round(share, 4)}
        if step_ms is not None:
            row["ms_per_step"] = round(share * step_ms, 3)
        rows.append(row)
    return rows


def callees(samples, thread: str, anchor: str) -> Counter:
    """Samples of `thread` under `anchor`, by the frame called right below its outermost occurrence
    (`(self)` where the stack ends at the anchor)."""
    below = Counter()
    for label, frames, count in samples:
        if label != thread or anchor not in frames:
            continue
        index = frames.index(anchor)
        below[frames[index + 1] if index + 1 < len(frames) else "(self)"] += count
    return below


def breakdown(
    text: str, rate_hz: float, step_ms: float | None = None, anchor: str | None = None, top: int = 40
) -> dict:
    """Per thread, samples and seconds; for the engine loop's thread, the functions by inclusive samples (each
    counted once per stack) and by self samples (the innermost frame), as shares of its samples and, with the
    measured `step_ms`, as milliseconds a step; with `anchor`, its direct callees the same way."""
    samples = parse(text)
    totals = thread_totals(samples)
    main = main_thread(samples)
    total = totals[main]
    inclusive, own = Counter(), Counter()
    for label, frames, count in samples:
        if label != main:
            continue
        for function in set(frames):
            inclusive[function] += count
        own[frames[-1] if frames else "(no frame)"] += count
    result = {
        "rate_hz": rate_hz,
        "threads": {label: {"samples": n, "seconds": round(n / rate_hz, 3)} for label, n in totals.items()},
        "main_thread": main,
        "main_samples": total,
        "step_ms": step_ms,
        "inclusive": _entries(inclusive, total, step_ms, top),
        "self": _entries(own, total, step_ms, top),
    }
    if anchor:
        below = callees(samples, main, anchor)
        result["anchor"] = {"function": anchor, "callees": _entries(below, total, step_ms, top)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--rate", type=float, default=1000.0, help="py-spy's --rate (samples a second)")
    parser.add_argument("--step-ms", type=float, default=None, help="measured step time, for ms a step")
    parser.add_argument("--anchor", default=None, help="a function whose direct callees to list")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(json.dumps(breakdown(read_raw(args.raw), args.rate, args.step_ms, args.anchor, args.top), indent=1))


if __name__ == "__main__":
    main()
