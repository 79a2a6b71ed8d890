"""The tiny quality gate has teeth: the trained default variant passes thresholds above chance, and a destroyed
checkpoint served the same way fails the same gate (recorded as failed, and `tarball` refuses it).
The two e2e tests need Docker, the stage venvs and the tiny DAG."""

import json
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT, TINY as TINY_ARGS, snakemake
from lib.stage import StageError, validate_json, write_manifest
from tarball import require_passed_gate

TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
VARIANT = TINY["variant"]
DESTROYED = "tiny-scrambled-mtp1"
COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
CHANCE = {"tiny_mc": 0.25, "tiny_mc_think": 0.25}  # four options, letters balanced; IFEval has no chance level

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


def test_thresholds_sit_above_chance():
    for task in TINY["quality"]["tasks"]:
        assert task["threshold"] > CHANCE.get(task["name"], 0.0), task


@pytest.mark.e2e
def test_default_variant_passes_clearly_above_chance(tiny_run):
    quality = json.loads((ROOT / "results" / VARIANT / "quality_gate" / "quality.json").read_text())
    validate_json(quality, ROOT / "schemas" / "quality.schema.yaml")
    assert quality["passed"] is True
    thresholds = {t["name"]: t["threshold"] for t in TINY["quality"]["tasks"]}
    for row in quality["tasks"]:
        assert row["passed"] and row["margin"] >= 0, row
        assert row["threshold"] == thresholds[row["name"]] > CHANCE.get(row["name"], 0.0), row


@pytest.mark.e2e
def test_destroyed_checkpoint_fails_the_gate(tiny_run, tmp_path):
    # The destroyed model enters where quantize's output would: quantize's held-out guard would (rightly)
    # refuse it, and this test is about the gate stopping it on its own, so the test scrambles that output.
    recipe = tmp_path / "scrambled.yaml"
    recipe.write_text((ROOT / "recipes" / "bf16.yaml").read_text())
    out = ROOT / "results" / "quantize" / recipe.stem
    shutil.rmtree(out, ignore_errors=True)
    extra = tmp_path / "scrambled-variant.yaml"
    # One short probe request per prompt set (the bake warms that size only): the gate waits for the probe, whose
    # numbers this test does not read. Eight docs a task: a model guessing at chance (0.25 on four options) gets 7 of 8
    # right, the 0.8 threshold, about once in 2,600 tries per task (both must fail: ~1 run in 1,300 if it guessed).
    extra.write_text(
        yaml.safe_dump(
            {
                "variants": {DESTROYED: dict(TINY["variants"][VARIANT], recipe=str(recipe))},
                "probe": {
                    "warmup": 0,
                    "runs": 1,
                    "categories": [{"name": "short", "prompt_tokens": 64, "output_tokens": 16}],
                },
                "quality": {"limit": 8},
            }
        )
    )
    # quantize runs for real (a plain copy, recipes/bf16.yaml), then its output is scrambled in place: Snakemake's
    # own record of the job stays valid, and the later jobs read the scrambled files
    snakemake("--cores", "2", str((out / "report.json").relative_to(ROOT)), *TINY_ARGS, str(extra))
    for shard in sorted((out / "model").glob("*.safetensors")):  # the script leaves non-language-model tensors
        subprocess.run([str(COMPRESS), "-c", SCRAMBLE, str(shard)], check=True)
    write_manifest(out / "model", out / "manifest.json")
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps(dict(report, note="scrambled by tests/test_gate_teeth.py")))

    quality_path = ROOT / "results" / DESTROYED / "quality_gate" / "quality.json"
    # mtime only: the scrambled files are newer than their inputs, so Snakemake keeps them
    try:
        snakemake(
            "--cores", "2", str(quality_path.relative_to(ROOT)), *TINY_ARGS, str(extra), "--rerun-triggers", "mtime"
        )
        # the scrambled checkpoint is what was served: quantize did not run again over it
        assert "scrambled" in json.loads((out / "report.json").read_text()).get("note", "")
        quality = json.loads(quality_path.read_text())
        print(json.dumps(quality["tasks"], indent=1))  # the scores, for whoever reads the test log
        validate_json(quality, ROOT / "schemas" / "quality.schema.yaml")
        assert quality["passed"] is False
        failed = {row["name"] for row in quality["tasks"] if not row["passed"]}
        assert {"tiny_mc", "tiny_mc_think"} <= failed, quality["tasks"]
        with pytest.raises(StageError, match="quality gate"):
            require_passed_gate(str(quality_path))  # what `tarball` does before it writes image.tar.gz
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(ROOT / "results" / DESTROYED, ignore_errors=True)
