"""A model checkpoint folder written as a whole: built aside, renamed into place, then its manifest and record.

A failed or interrupted run never leaves a checkpoint, manifest or record that a rerun would trust."""

import shutil
import time
from pathlib import Path
from typing import Callable

from lib.stage import validate_json, write_json, write_manifest


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
