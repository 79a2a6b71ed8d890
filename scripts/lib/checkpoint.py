"""A model checkpoint folder written as a whole: built aside, renamed into place, then its manifest and record.

A failed or interrupted run never leaves a checkpoint, manifest or record that a rerun would trust; and a stage
that reads a checkpoint made by an earlier run first checks it against that manifest (verify_manifest), so a file
changed, lost or added since is never trusted."""

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from lib.stage import StageError, checkpoint_files, sha256_file, validate_json, write_json, write_manifest


def materialise(checkpoint: str | Path, fill: Callable[[Path], object]) -> Path:
    """Run fill(tmp_dir), then rename tmp_dir to `checkpoint`; on any failure remove both."""
    checkpoint = Path(checkpoint)
    tmp = checkpoint.with_name(checkpoint.name + ".partial")
    for path in (tmp, checkpoint):
        shutil.rmtree(path, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        tmp.rename(checkpoint)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint


def write_checkpoint(output, fill: Callable[[Path], dict | None], record: dict, schema: str | Path) -> dict:
    """fill(tmp_dir) builds the checkpoint (output.checkpoint); then its manifest (output.manifest) and, when the
    job has output.record, `record` updated with what fill returned and the seconds, files and bytes it took.
    `record["seconds"]`, when given, is time already spent on this checkpoint by an earlier step."""
    record_path = getattr(output, "record", None)
    for path in (output.manifest, record_path):
        if path:
            Path(path).unlink(missing_ok=True)
    start = time.monotonic()
    filled: dict = {}
    checkpoint = materialise(output.checkpoint, lambda tmp: filled.update(fill(tmp) or {}))
    manifest = write_manifest(checkpoint, output.manifest)
    record = dict(
        record,
        **filled,
        seconds=round(record.get("seconds", 0) + time.monotonic() - start, 1),
        files=len(manifest),
        bytes=sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file()),
    )
    if record_path:
        validate_json(record, schema)
        write_json(record_path, record)
    return record


def verify_manifest(checkpoint: str | Path, manifest_path: str | Path, allow_empty: bool = False) -> dict[str, str]:
    """Check every file of `checkpoint` against the sha256 manifest written when it was made (for download's, after
    each file was checked against the hub's own hashes): the same files, the same bytes. Snakemake reruns a stage
    whose inputs are newer, never one whose input folder changed inside, so the stage that reads it checks.
    Returns the manifest; a missing, extra or changed file raises StageError naming it."""
    checkpoint, manifest_path = Path(checkpoint), Path(manifest_path)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise StageError(f"cannot read the manifest {manifest_path} of {checkpoint}: {error}") from error
    if not isinstance(manifest, dict) or not (manifest or allow_empty):
        raise StageError(f"{manifest_path} is not a manifest (a non-empty {{file: sha256}} object)")
    present = {str(path.relative_to(checkpoint)): path for path in checkpoint_files(checkpoint)}
    problems = [f"{name}: missing" for name in sorted(set(manifest) - set(present))]
    problems += [f"{name}: not in the manifest" for name in sorted(set(present) - set(manifest))]
    for name in sorted(set(manifest) & set(present)):
        actual = sha256_file(present[name])
        if actual != manifest[name]:
            problems.append(f"{name}: sha256 {actual}, the manifest says {manifest[name]}")
    if problems:
        raise StageError(
            f"{checkpoint} no longer matches its manifest {manifest_path} (changed since it was made and verified):\n  "
            + "\n  ".join(problems)
            + f"\nremove {checkpoint} and {manifest_path} and rerun: Snakemake makes them again (download re-fetches "
            "and re-verifies against the hub)"
        )
    return manifest
