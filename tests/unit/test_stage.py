"""lib/stage.py's plumbing: a stage's error reaches its output once, and a record is on disk before it replaces the
old one."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from lib import stage
from lib.dag import lock

FAILING_STAGE = """
from lib.stage import StageError, run_stage
def main(job):
    raise StageError("the input is bad")
run_stage(main)
"""


def test_a_stage_error_is_printed_once(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"rule": "x", "log": []}))
    run = subprocess.run(
        [sys.executable, "-c", FAILING_STAGE, "--job", str(tmp_path / "job.json")],
        env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert (run.stdout + run.stderr).count("ERROR [x]: the input is bad") == 1, run.stderr


def synced_writes(monkeypatch, write) -> list[tuple[str, str]]:
    """(call, path) of every fsync and os.replace `write` makes, in order."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write()
    return calls


def test_a_record_is_synced_before_it_replaces_the_old_one_and_its_folder_after(tmp_path, monkeypatch):
    path = tmp_path / "out" / "record.json"
    calls = synced_writes(monkeypatch, lambda: stage.write_json(path, {"a": 1}))
    assert [call for call, _ in calls] == ["fsync", "replace", "fsync"]
    assert calls[0][1] == calls[1][1] != str(path)  # the temporary file, written whole first
    assert calls[2][1] == str(path.parent)
    assert json.loads(path.read_text()) == {"a": 1} and os.stat(path).st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]


def test_a_lock_entry_is_synced_the_same_way(tmp_path, monkeypatch):
    path = tmp_path / "datasets" / "org" / "calib.yaml"
    calls = synced_writes(monkeypatch, lambda: lock.write_entry(path, "datasets", "org/calib", "0" * 40))
    assert [call for call, _ in calls] == ["fsync", "replace", "fsync"]
    assert calls[0][1] == calls[1][1] and calls[2][1] == str(path.parent)
    assert lock.read_entry(path).value == "0" * 40


def test_a_failed_replace_leaves_the_old_record_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    stage.write_json(path, {"old": True})

    def refuse(src, dst):
        raise OSError("no")

    monkeypatch.setattr(os, "replace", refuse)
    try:
        stage.write_json(path, {"new": True})
    except OSError:
        pass
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(Path(tmp_path).iterdir()) == [path]
