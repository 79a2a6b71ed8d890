"""Which stages reach the hub: run_stage turns the hub off for every stage but the fetching ones, and only
download, download_draft and download_datasets ask for it (tests/e2e/test_download_datasets.py fetches for real)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

STAGE = """
import os, sys
from lib.stage import run_stage
def main(job):
    print("OFFLINE", os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE"))
run_stage(main, online=sys.argv[1] == "online")
"""


@pytest.mark.parametrize("online", [False, True])
def test_every_stage_but_the_fetching_ones_runs_with_the_hub_off(tmp_path, online):
    (tmp_path / "job.json").write_text(json.dumps({"rule": "x", "log": []}))
    env = {"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", STAGE, "online" if online else "offline", "--job", str(tmp_path / "job.json")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == (["OFFLINE", "None", "None"] if online else ["OFFLINE", "1", "1"])


def test_only_the_three_fetching_stages_run_with_the_hub_on():
    """download, download_draft and download_datasets reach the hub (and read HF_TOKEN); every other stage runs with
    it off, so the docs name exactly these three."""
    online = sorted(path.stem for path in (ROOT / "scripts").glob("*.py") if "online=True" in path.read_text())
    assert online == ["download", "download_datasets", "download_draft"]
