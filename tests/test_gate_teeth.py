"""The tiny quality gate has teeth: the trained default variant passes it, a destroyed checkpoint served the
same way fails it (non-zero exit, no quality.json). e2e: Docker, the stage venvs and the tiny DAG."""

import json
import subprocess

import pytest
import yaml

from common import validate_json, write_manifest
from conftest import ROOT, TINY as TINY_ARGS, snakemake

pytestmark = pytest.mark.e2e

TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
VARIANT = TINY["variant"]
DESTROYED = "tiny-destroyed-mtp1"
COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
EVAL = ROOT / ".venvs" / "eval" / "bin" / "python"

# Every language-model matrix keeps its values but in a seeded random order: the same dtype, shapes, norms and
# value statistics (nothing a loader or a NaN check would notice), none of what training put there.
SCRAMBLE = """
import sys, torch
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = load_file(path)
gen = torch.Generator().manual_seed(0)
for name, t in tensors.items():
    if t.dim() == 2 and "language_model" in name:
        tensors[name] = t.flatten()[torch.randperm(t.numel(), generator=gen)].reshape(t.shape).contiguous()
save_file(tensors, path, metadata={"format": "pt"})
"""


def test_default_variant_passes_clearly_above_chance(tiny_run):
    quality = json.loads((ROOT / "results" / VARIANT / "quality_gate" / "quality.json").read_text())
    validate_json(quality, ROOT / "schemas" / "quality.schema.yaml")
    assert quality["passed"] is True
    thresholds = {t["name"]: t["threshold"] for t in TINY["quality"]["tasks"]}
    chance = {"tiny_mc": 0.25, "tiny_mc_think": 0.25}  # four options; IFEval has no chance level
    for row in quality["tasks"]:
        assert row["passed"] and row["margin"] >= 0, row
        assert row["threshold"] == thresholds[row["name"]] > chance.get(row["name"], 0.0), row


def test_destroyed_checkpoint_fails_the_gate(tiny_checkpoint, tiny_base_image, tmp_path):
    # The destroyed model enters where quantize's output would: quantize's held-out guard would (rightly)
    # refuse it, and this test is about the gate stopping it on its own, so the test bypasses that stage.
    out = ROOT / "results" / DESTROYED / "quantize"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(tiny_checkpoint), str(out / "model")], check=True)
    subprocess.run([str(COMPRESS), "-c", SCRAMBLE, str(out / "model" / "model.safetensors")], check=True)
    write_manifest(out / "model", out / "manifest.json")
    (out / "report.json").write_text(json.dumps({"variant": DESTROYED, "note": "scrambled by tests/test_gate_teeth.py"}))

    serve = dict(TINY["variants"][VARIANT]["serve"])
    extra = tmp_path / "destroyed.yaml"
    extra.write_text(yaml.safe_dump({"variants": {DESTROYED: {
        "recipe": "recipes/bf16.yaml", "serve": serve, "speculative": TINY["variants"][VARIANT]["speculative"]}}}))
    # mtime only: the hand-made quantize outputs are newer than their inputs, so Snakemake keeps them
    snakemake("--cores", "2", f"results/{DESTROYED}/build_image/image.json", *TINY_ARGS, str(extra),
              "--rerun-triggers", "mtime")

    # The gate script itself (the latency probe, which only orders the real DAG, is not needed here).
    job = {
        "rule": "quality_gate",
        "input": {"image": str(ROOT / "results" / DESTROYED / "build_image" / "image.json")},
        "output": {"scores": str(tmp_path / "quality.json")},
        "params": {"model_name": serve.get("served_model_name", "Qwen/Qwen3.5-4B"), "tasks": TINY["quality"]["tasks"],
                   "limit": TINY["quality"]["limit"], "num_concurrent": TINY["quality"]["num_concurrent"],
                   "tasks_dir": str(ROOT / TINY["quality"]["tasks_dir"]), "gpus": False, "shm_size": "1g",
                   "ping_timeout_s": 900, "reference_variant": None},
        "log": [str(tmp_path / "gate.log")], "threads": 1, "wildcards": {"variant": DESTROYED},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    result = subprocess.run([str(EVAL), str(ROOT / "scripts" / "quality_gate.py"), "--job", str(tmp_path / "job.json")],
                            capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/local/bin:/usr/bin:/bin"})
    output = result.stdout + result.stderr
    print(output[-4000:])  # the table, for whoever reads the test log
    assert result.returncode != 0, output
    assert "quality gate failed" in output
    assert not (tmp_path / "quality.json").exists()
    report = json.loads((tmp_path / "gate.scores.json").read_text())
    validate_json(report, ROOT / "schemas" / "quality.schema.yaml")
    assert report["passed"] is False
    failed = {row["name"] for row in report["tasks"] if not row["passed"]}
    assert {"tiny_mc", "tiny_mc_think"} <= failed, report["tasks"]
