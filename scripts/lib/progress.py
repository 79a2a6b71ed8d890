"""Progress lines for long waits: a stage that waits or loops for minutes says what it is doing.

A `Heartbeat` is a context manager whose daemon thread prints `describe()` every PROGRESS_INTERVAL_S seconds while
its block runs, so a single long blocking call (an lm-eval task, a 27 s CPU request, a vLLM start-up) still gives a
line at least that often. Each line goes to the stage's output (its rule's log) and, when lib/stage.run_stage
redirected that, to the console too. Stdlib only: imported by the driver and by every stage venv.
"""

import os
import sys
import threading
import time
from typing import Callable

from lib.stage import CONSOLE_FD_ENV

# Seconds between two progress lines of one wait or loop (the console should never stay silent longer).
PROGRESS_INTERVAL_S = 30.0


def to_console(line: str) -> None:
    """Also write the line to the console when the stage's own output goes to its log (lib/stage.run_stage)."""
    fd = os.environ.get(CONSOLE_FD_ENV)
    if not fd:
        return
    try:
        os.write(int(fd), (line.rstrip("\n") + "\n").encode(errors="replace"))
    except (OSError, ValueError):
        pass  # no console (closed, or not a number): the log still has the line


def elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class Heartbeat:
    """Print `describe(elapsed_s)` every `interval_s` (PROGRESS_INTERVAL_S unless given) while the block runs.

    describe gets the seconds since the block started; an exception it raises becomes part of the line (a progress
    line must never stop the work it reports on)."""

    def __init__(
        self,
        describe: Callable[[float], str],
        interval_s: float | None = None,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.describe = describe
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else float(interval_s)
        if self.interval_s <= 0:
            raise ValueError(f"progress interval must be positive, not {interval_s!r}")
        self.log = log or (lambda line: print(line, flush=True, file=sys.stdout))
        self.clock = clock
        self.lines = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0.0

    def line(self) -> str:
        try:
            return self.describe(self.clock() - self.started)
        except Exception as error:  # noqa: BLE001 - reported, never raised
            return f"(progress unavailable: {type(error).__name__}: {error})"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.line()
            self.log(line)
            sys.stdout.flush()
            to_console(line)
            self.lines += 1

    def __enter__(self) -> "Heartbeat":
        self.started = self.clock()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def bytes_under(path) -> str:
    """What a download has written so far under `path` (its files' sizes summed), as a short "1.23 GB"."""
    from pathlib import Path

    total = 0
    for item in Path(path).rglob("*"):
        try:
            total += item.stat().st_size if item.is_file() else 0
        except OSError:  # renamed or removed while we look
            pass
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"
