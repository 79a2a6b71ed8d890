"""Where the engine core's host time goes, from py-spy's raw output (`py-spy record --format raw --threads`).

The torch profiler sees PyTorch operators and roughly doubles the host time it measures; py-spy samples the Python
stacks of a running process from outside at a fixed rate, so a function's share of one thread's samples is its
share of that thread's time. Sampled with `--idle` (wall clock) the main thread has a sample at every tick, and a
share times the measured step time is milliseconds a step; sampled without it, the shares are of on-CPU time.

A raw line is `thread (TID): NAME;frame;frame;... COUNT`, root first, each frame `function (file.py:line)`; py-spy
names a method by its class (`EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1364)`), so a function given by
its bare name (`run_busy_loop`) matches any class and file.

    python3 gpu_proof/spy_breakdown.py RAW.txt[.gz] [--step-ms 4.7] [--anchor step_with_batch_queue]
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
ENGINE_LOOP = "run_busy_loop"
ENGINE_STEP = "step_with_batch_queue"  # one engine step under async scheduling: its parts a step
# the two windows and their py-spy flags: with --idle (a sample every tick), then without (on-CPU samples only)
WINDOW_FLAGS = {"wall": ("--idle",), "cpu": ()}
WINDOWS = tuple(WINDOW_FLAGS)
# innermost frames that only wait for the GPU: torch's CUDA event wait, and vLLM 0.26's wait for the previous step's
# accepted counts (its self time is a C-level event's synchronize and a one-element tolist). CUDA spins while it
# waits, so these samples count as on-CPU too: they tell GPU waits from host work in either window
GPU_WAITS = ("Event.synchronize", "_get_valid_sampled_token_count")


def read_raw(path: Path) -> str:
    return (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode()


def function_of(frame: str) -> str:
    """`execute_model (gpu_model_runner.py:4111)` -> `execute_model (gpu_model_runner.py)`: one entry per function."""
    return FRAME_LINE.sub(")", frame)


def is_named(function: str, name: str) -> bool:
    """Whether `function` (`Class.method (file)`) is `name`: the same label, or the same bare or qualified name."""
    qualified = function.split(" (", 1)[0]
    return function == name or qualified == name or qualified.endswith("." + name)


def first_named(frames: tuple[str, ...], name: str) -> int | None:
    return next((index for index, frame in enumerate(frames) if is_named(frame, name)), None)


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
        if first_named(frames, loop) is not None:
            inside[thread] += count
    if not inside:
        raise ValueError(f"no thread runs {loop}: not an engine core's stacks")
    return inside.most_common(1)[0][0]


def _share(count: int, total: int, step_ms: float | None) -> dict:
    """Samples, their share of the thread's, and with the measured step time, ms a step."""
    row = {"samples": count, "share": round(count / total, 4)}
    if step_ms is not None:
        row["ms_per_step"] = round(count / total * step_ms, 3)
    return row


def _entries(counts: Counter, total: int, step_ms: float | None, top: int) -> list[dict]:
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]  # ties by name
    return [{"function": name, **_share(count, total, step_ms)} for name, count in ranked]


def callees(samples, thread: str, anchor: str) -> Counter:
    """Samples of `thread` under `anchor`, by the frame called right below its outermost occurrence
    (`(self)` where the stack ends at the anchor)."""
    below = Counter()
    for label, frames, count in samples:
        index = first_named(frames, anchor) if label == thread else None
        if index is None:
            continue
        below[frames[index + 1] if index + 1 < len(frames) else "(self)"] += count
    return below


def breakdown(
    text: str, rate_hz: float, step_ms: float | None = None, anchor: str | None = None, top: int = 40
) -> dict:
    """Per thread, samples and seconds; for the engine loop's thread, its GPU waits (GPU_WAITS), the functions by
    inclusive samples (each counted once per stack) and by self samples (the innermost frame), as shares of its
    samples and, with the measured `step_ms`, as milliseconds a step; with `anchor`, its direct callees the same way."""
    samples = parse(text)
    totals = thread_totals(samples)
    main = main_thread(samples)
    total = totals[main]
    inclusive, own, waits = Counter(), Counter(), 0
    for label, frames, count in samples:
        if label != main:
            continue
        for function in set(frames):
            inclusive[function] += count
        own[frames[-1] if frames else "(no frame)"] += count
        waits += count if frames and any(is_named(frames[-1], name) for name in GPU_WAITS) else 0
    result = {
        "rate_hz": rate_hz,
        "threads": {label: {"samples": n, "seconds": round(n / rate_hz, 3)} for label, n in totals.items()},
        "main_thread": main,
        "main_samples": total,
        "step_ms": step_ms,
        "gpu_wait": _share(waits, total, step_ms),
        "inclusive": _entries(inclusive, total, step_ms, top),
        "self": _entries(own, total, step_ms, top),
    }
    if anchor:
        below = callees(samples, main, anchor)
        result["anchor"] = {"function": anchor, "callees": _entries(below, total, step_ms, top)}
    return result


def window_breakdowns(raws: dict[str, Path], rate_hz: float, step_ms: float | None) -> dict[str, dict]:
    """The breakdown of each window's raw file (gzipped or not), the engine step as the anchor."""
    return {window: breakdown(read_raw(raw), rate_hz, step_ms, anchor=ENGINE_STEP) for window, raw in raws.items()}


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
