"""download_draft for real, in the compress venv: it makes the tiny drafter from the trained tiny checkpoint and
refuses one that does not fit the target (tests/unit/test_dflash.py: DFlash as configuration)."""

import json
from pathlib import Path

import pytest

from conftest import ROOT

TINY_DRAFTER = {
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "target_layer_ids": [0, 1],
    "block_size": 4,
    "seed": 0,
}


def run_download_draft(python, tmp_path, target: Path, drafter: dict, name: str):
    from hub_standin import StandinHub, run_stage_script

    out = tmp_path / name
    job = {
        "rule": "download_draft",
        "threads": 1,
        "log": [],
        "wildcards": {"draft": "tiny--dflash"},
        "input": {
            "target": str(target),
            "target_manifest": "",
            "schema": str(ROOT / "schemas" / "download.schema.yaml"),
        },
        "output": {
            "checkpoint": str(out / "checkpoint"),
            "manifest": str(out / "manifest.json"),
            "record": str(out / "download.json"),
        },
        "params": {"source": "synthetic", "draft": {"repo": "tiny/dflash", "revision": None}, "tiny": drafter},
    }
    with StandinHub() as hub:  # the synthetic path reaches no hub; the helper wants one
        return run_stage_script(python, ROOT / "scripts" / "download_draft.py", job, hub, tmp_path), out


@pytest.mark.e2e  # the compress venv (torch) and the trained tiny checkpoint
def test_download_draft_makes_the_tiny_drafter_and_refuses_one_that_does_not_fit(tmp_path, tiny_venvs, tiny_checkpoint):
    done, out = run_download_draft(tiny_venvs["compress"], tmp_path, tiny_checkpoint, TINY_DRAFTER, "good")
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    target = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    assert config["hidden_size"] == config["target_hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"] and config["dflash_config"]["block_size"] == 4
    record = json.loads((out / "download.json").read_text())
    assert record["source"] == "synthetic" and sorted(json.loads((out / "manifest.json").read_text())) == [
        "config.json",
        "model.safetensors",
    ]
    deep = dict(TINY_DRAFTER, target_layer_ids=[0, target["num_hidden_layers"] - 1])
    done, out = run_download_draft(tiny_venvs["compress"], tmp_path, tiny_checkpoint, deep, "deep")
    assert done.returncode != 0 and "target_layer_ids [0, 3] must be ids 0..2" in done.stderr
    assert not (out / "checkpoint").exists() and not (out / "download.json").exists()
