"""The tiny quality gate has teeth: the trained default variant passes thresholds above chance, and a destroyed
checkpoint served the same way fails the same gate's verdict (the stage venvs and the tiny DAG)."""

import json
import shutil
import subprocess

import pytest

from conftest import ROOT, host_server
from lib.stage import validate_json
from serving.settings import serve_json
from unit.test_gate_teeth import CHANCE, TINY

VARIANT = TINY["variant"]
DESTROYED = "tiny-scrambled-mtp1"
COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
EVAL = ROOT / ".venvs" / "eval" / "bin" / "python"

# Every language-model matrix keeps its values but in a seeded random order: the same dtype, shapes, norms and
# value statistics (nothing a loader or a NaN check would notice), none of what training put there.
# Every shard in one process (argv[1:]): torch's import is most of a run.
SCRAMBLE = """
import sys, torch
from safetensors.torch import load_file, save_file
for path in sys.argv[1:]:
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.dim() == 2 and "language_model" in name:
            tensors[name] = t.flatten()[torch.randperm(t.numel(), generator=gen)].reshape(t.shape).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
"""


@pytest.mark.e2e
def test_default_variant_passes_clearly_above_chance(tiny_run):
    quality = json.loads((ROOT / "results" / VARIANT / "quality_gate" / "quality.json").read_text())
    validate_json(quality, ROOT / "schemas" / "quality.schema.yaml")
    assert quality["passed"] is True
    thresholds = {t["name"]: t["threshold"] for t in TINY["quality"]["tasks"]}
    for row in quality["tasks"]:
        assert row["passed"] and row["margin"] >= 0, row
        assert row["threshold"] == thresholds[row["name"]] > CHANCE.get(row["name"], 0.0), row


# Run in the eval venv (lm-eval's): quality_gate's own lm-eval run and verdict against a served model.
GATE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import quality_gate as gate
settings = json.loads(sys.argv[2])
tasks = gate.normalize_tasks(settings["tasks"])
scores = gate.run_lm_eval(settings["base"], tasks, model_name=settings["model_name"], num_concurrent=4,
                          limit=settings["limit"], tasks_dir=settings["tasks_dir"])
passed, rows = gate.evaluate_gate(scores, tasks, None, 0)
print("GATE " + json.dumps({"passed": passed, "rows": rows}))
"""


@pytest.mark.e2e
def test_destroyed_checkpoint_fails_the_gate(tiny_run, tmp_path):
    """The trained checkpoint with its matrices scrambled, served by the image's entrypoint on the host with the
    default variant's settings (eager), scored by quality_gate's own lm-eval run and verdict: it fails the
    thresholds the trained model passes. (The stage's failure path around this verdict, the record, tarball refusing
    it and the container stopped, is e2e/test_pipeline.py's test_gate_with_teeth_fails_and_stops_its_container.)"""
    model = tmp_path / "scrambled"
    shutil.copytree(ROOT / "weights" / TINY["model"]["name"] / "checkpoint", model)
    shards = sorted(map(str, model.glob("*.safetensors")))  # the script leaves non-language-model tensors
    subprocess.run([str(COMPRESS), "-c", SCRAMBLE, *shards], check=True)
    # the gate reads answers, not speed: no speculation, and eager (a compile would add ~40 s on 2 cores)
    serve = {**serve_json(TINY["variants"][VARIANT]["serve"], {"method": "none"}), "enforce_eager": True}
    with host_server(model, serve, tmp_path / "server") as base:
        # Eight docs a task: a model guessing at chance (0.25 on four options) gets 7 of 8 right, the 0.8
        # threshold, about once in 2,600 tries per task (both must fail: ~1 run in 1,300 if it guessed).
        settings = {
            "base": base,
            "model_name": serve["served_model_name"],
            "tasks": TINY["quality"]["tasks"],
            "tasks_dir": str(ROOT / TINY["quality"]["tasks_dir"]),
            "limit": 8,
        }
        result = subprocess.run(
            [str(EVAL), "-c", GATE, str(ROOT / "scripts"), json.dumps(settings)],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    verdict = json.loads(result.stdout.rsplit("GATE ", 1)[1])
    print(json.dumps(verdict["rows"], indent=1))  # the scores, for whoever reads the test log
    assert verdict["passed"] is False
    failed = {row["name"] for row in verdict["rows"] if not row["passed"]}
    assert {"tiny_mc", "tiny_mc_think"} <= failed, verdict["rows"]
