"""What a GPU-proof driver writes: one JSON a step in STATE/results (re-packed into STATE/results.tar.gz after every
write, so what is done survives a host taken back), and its servers' markers on the host, which every driver there
reads: a probe waits until no server is STARTING, and a group starts only when few enough are RESIDENT."""

from __future__ import annotations

import fcntl
import json
import os
import tarfile
from contextlib import contextmanager
from pathlib import Path

import plan  # noqa: F401  (it puts scripts/ on sys.path, for lib)
from lib.decode_bytes import draft_passes, step_bytes, step_total
from lib.stage import sha256_file

# every timing (the bandwidth, each probe) holds this host-wide lock, so no two drivers' timings overlap
PROBE_LOCK = Path(os.environ.get("PROBE_LOCK", "/tmp/gpu-proof-probe.lock"))
# a marker a server starting on the host (any driver's): its compiling loads the CPUs that set a step's pace
STARTING = Path(os.environ.get("PROBE_STARTING", "/tmp/gpu-proof-starting"))
# a marker a server on the host from before its start until it is stopped (what --max-resident counts)
RESIDENT = Path(os.environ.get("PROBE_RESIDENT", "/tmp/gpu-proof-resident"))
COMPILE_LOG_MARKS = ("torch.compile took", "Directly load", "Compiling a graph", "compile range", "Cache the graph")


def cpu_model() -> str | None:
    """The host's CPU model names (/proc/cpuinfo), joined where they differ."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    models = {line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")}
    return " / ".join(sorted(models)) or None


def write(state: Path, name: str, data: dict) -> None:
    """STATE/results/<name>.json, then the whole results folder as STATE/results.tar.gz (each written aside)."""
    path = state / "results" / f"{name}.json"
    path.with_name(path.name + ".partial").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    path.with_name(path.name + ".partial").replace(path)
    with tarfile.open(state / "results.tar.gz.partial", "w:gz") as archive:
        archive.add(state / "results", arcname="results")
    (state / "results.tar.gz.partial").replace(state / "results.tar.gz")


def read(state: Path, name: str) -> dict | None:
    path = state / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


@contextmanager
def host_lock(path: Path):
    """A host-wide lock (fcntl: released when its process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def on_host(folder: Path) -> list[str]:
    """The markers in `folder` (`<driver pid>-<state>-<variant>`) whose driver is alive; a dead driver's are dropped."""
    alive = []
    for marker in sorted(folder.glob("*")) if folder.is_dir() else []:
        try:
            os.kill(int(marker.name.split("-", 1)[0]), 0)
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
            continue
        except PermissionError:
            pass  # alive, another user's
        alive.append(marker.name)
    return alive


def mark(folder: Path, name: str, on: bool) -> None:
    if on:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()
    else:
        (folder / name).unlink(missing_ok=True)


def bytes_per_step(record: dict) -> int:
    """The weights a decode step of the variant reads: decoder and head, plus MTP's draft passes or a drafter's."""
    passes = draft_passes(record["speculative"])
    return step_total(step_bytes(record["weights"], passes), passes, record["drafter_bytes"])


def describe_checkpoint(path: Path) -> dict:
    """A given checkpoint's record: its files' sha256 (its builder says the weights are trained, not random)."""
    files = sorted(path.glob("*.safetensors"))
    record = {"kind": "checkpoint", "status": "ok", "path": str(path), "builder": "given (--checkpoint)"}
    record["architecture"] = json.loads((path / "config.json").read_text())["architectures"][0]
    record["weights_sha256"] = {file.name: sha256_file(file) for file in files}
    return record | {"total_bytes": sum(file.stat().st_size for file in files)}


def compile_lines(log: str, keep: int = 6) -> list[str]:
    """The lines of a server's log that say whether vLLM compiled or loaded its graphs (the last `keep`)."""
    found = [line.strip()[-240:] for line in log.splitlines() if any(sign in line for sign in COMPILE_LOG_MARKS)]
    return found[-keep:]


def tail(log_path: Path, lines: int = 30) -> str:
    text = Path(log_path).read_text(errors="replace").splitlines() if Path(log_path).exists() else []
    return "\n".join(text[-lines:])
