"""Plumbing every stage script shares: the job, its venv, records and manifests.

Each stage runs in its own virtualenv (see envs/), but Snakemake's `script:` directive always
runs the interpreter Snakemake itself runs under. `run_stage` bridges the two: under Snakemake it
unpacks the `snakemake` object into a plain JSON job and, when the rule names a venv, re-runs the
same script with that venv's Python, which reads the job back and calls the stage's `main(job)`.
"""

import errno
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable


class StageError(RuntimeError):
    """A failure the user can act on; printed as one clear message, never a traceback."""


def _named(items) -> dict[str, Any]:
    return {name: value for name, value in items.items()}


def job_from_snakemake(snakemake) -> dict[str, Any]:
    return {
        "rule": snakemake.rule,
        "input": _named(snakemake.input),
        "output": _named(snakemake.output),
        "params": _named(snakemake.params),
        "log": list(snakemake.log),
        "threads": snakemake.threads,
        "wildcards": _named(snakemake.wildcards),
    }


def _namespace(job: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in job.items()})


def venv_python(venv_marker: str) -> Path:
    """The interpreter of the venv whose readiness marker (`.venvs/<name>/pip-freeze.txt`) is given."""
    return Path(venv_marker).resolve().parent / "bin" / "python"


# The file descriptor of the console (Snakemake's stderr) in a stage whose output goes to its rule's log: progress
# lines of long waits (lib/progress.py) are written to both.
CONSOLE_FD_ENV = "PIPELINE_CONSOLE_FD"


# What every stage but the fetching ones (download, download_draft, download_datasets) runs with: the hub switched
# off, so a stage that would reach it for a file nobody fetched fails at once, naming it, instead of depending on
# the network.
HUB_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_stage(
    main: Callable[[SimpleNamespace], None], snakemake=None, script: str | None = None, online: bool = False
) -> None:
    """Entry point of every stage script (its `__main__` block). Only a stage that fetches passes online=True."""
    if not online:
        os.environ.update(HUB_OFFLINE_ENV)  # before main imports huggingface_hub or datasets, which read it once
    if snakemake is None:  # re-executed inside the stage's venv
        job = json.loads(Path(sys.argv[sys.argv.index("--job") + 1]).read_text())
        _call(main, job)
        return
    job = job_from_snakemake(snakemake)
    venv_marker = job["input"].get("venv")
    if venv_marker is None or Path(sys.prefix).resolve() == venv_python(venv_marker).parent.parent:
        _call(main, job, log_path=job["log"][0] if job["log"] else None)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(job, handle)
    # the script's folder first, so `lib` is this project's package in the venv too
    console = os.dup(2)  # the stage's output goes to its log; progress lines (lib/progress.py) also come here
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(script).resolve().parent),
        PYTHONUNBUFFERED="1",
        **{CONSOLE_FD_ENV: str(console)},
    )
    log = open(job["log"][0], "a") if job["log"] else None
    try:
        result = subprocess.run(
            [str(venv_python(venv_marker)), script, "--job", handle.name],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(console,),
        )
    finally:
        os.close(console)
        os.unlink(handle.name)
        if log:
            log.close()
    if result.returncode != 0:
        tail = Path(job["log"][0]).read_text().splitlines()[-25:] if job["log"] else []
        sys.exit(
            f"rule {job['rule']} failed (exit {result.returncode}); "
            f"end of {job['log'][0] if job['log'] else 'output'}:\n" + "\n".join(tail)
        )


def _call(main, job: dict[str, Any], log_path: str | None = None) -> None:
    if log_path:  # same interpreter: send our own output to the rule's log as the venv path does
        os.environ.setdefault(CONSOLE_FD_ENV, str(os.dup(2)))  # where progress lines also go (lib/progress.py)
        log = open(log_path, "a")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        main(_namespace(job))
    except StageError as error:
        sys.exit(f"ERROR [{job['rule']}]: {error}")  # printed to stderr (the log) once, by the exit itself


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# Snakemake marks a finished directory output with this file; it is bookkeeping, not part of a checkpoint. So are
# the lock files the datasets library leaves beside a cache it prepared or read (an offline read adds new ones).
SNAKEMAKE_MARKER = ".snakemake_timestamp"
LOCK_SUFFIX = ".lock"


def checkpoint_files(directory: str | Path) -> list[Path]:
    """Every file of a checkpoint folder, in a stable order, without Snakemake's marker or lock files."""
    return [
        path
        for path in sorted(Path(directory).rglob("*"))
        if path.is_file() and path.name != SNAKEMAKE_MARKER and not path.name.endswith(LOCK_SUFFIX)
    ]


def write_manifest(directory: str | Path, manifest_path: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under `directory`, keyed by relative path, written as sorted JSON."""
    directory = Path(directory)
    manifest = {
        str(path.relative_to(directory)): sha256_file(path)
        for path in checkpoint_files(directory)
        if str(path.relative_to(directory)) not in exclude
    }
    write_json(manifest_path, manifest)
    return manifest


def write_json(path: str | Path, data: Any, mode: int = 0o644) -> None:
    """Write atomically, so an interrupted stage never leaves a truncated JSON a rerun would trust. mode 0o600 keeps
    the file its owner's from creation on (the temp file is created so)."""
    write_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def write_atomically(path: str | Path, text: str, mode: int = 0o644) -> None:
    """The whole file or none of it: a temporary file in the same folder (where os.replace is atomic; a unique
    name, so two writers never share one), on disk before it is renamed over `path`, and the rename on disk after.
    Without the syncs a power loss could keep the rename but not the bytes: an empty record a rerun would trust."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".partial", delete=False)
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, mode)  # a temp file is 0600; serve.json is read by the image's own user
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem that cannot sync a folder still renamed
            raise
    finally:
        os.close(folder)


def validate_json(data: Any, schema_path: str | Path) -> None:
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        raise StageError(f"{schema_path}: " + "; ".join(f"{e.json_path}: {e.message}" for e in errors))
