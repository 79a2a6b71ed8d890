"""The tiny DAG's load probe record: the shipped image under load (tests/unit/test_load_probe.py: the request mix and
the verdict against a stand-in server)."""

import json

import pytest
import yaml

from conftest import ROOT
from lib.load_probe import load
from lib.stage import validate_json

# ----- the tiny image's record -----


@pytest.mark.e2e
def test_the_tiny_dag_probed_its_image_under_load(tiny_run):
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    record = json.loads((ROOT / "results" / tiny["variant"] / "load_probe" / "load.json").read_text())
    validate_json(record, ROOT / "schemas" / "load.schema.yaml")
    assert record["variant"] == tiny["variant"] and record["passed"]
    assert record["counts"]["requests"] == record["settings"]["requests"] == len(record["requests"])
    assert record["max_in_flight"] == record["settings"]["concurrency"] > 1
    assert record["counts"]["server_errors"] == record["counts"]["no_answer"] == 0
    assert all(record["latency_ms"][name]["count"] > 0 for name in ("overall", *load.ENDPOINTS))
    assert record["statuses"].get("413") == 1 and all(kind["sent"] >= 1 for kind in record["kinds"])
