"""Which stages a config change reruns once the tiny DAG has run: a changed K, recipe or gate dataset pin reruns
exactly the stages it reaches (tests/unit/test_dag.py: the DAG's shape)."""

import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import FROM_BAKE_ON, ROOT, TINY, snakemake


def planned_jobs(*extra: str) -> dict[str, int]:
    """Jobs a dry run would run, from Snakemake's job-stats table."""
    out = snakemake("-n", "image.tar.gz", *TINY, *extra).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def variant_override(tmp_path: Path, **changes) -> str:
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variant = tiny["variants"][tiny["variant"]]
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            variant[section][field] = value
        else:
            variant[section] = value
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"variants": {tiny["variant"]: variant}}))
    return str(override)


@pytest.mark.e2e
def test_changing_k_reruns_bake_and_after_only(tiny_run, tmp_path):
    assert planned_jobs() == {}
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    shipped_k = tiny["variants"][tiny["variant"]]["speculative"]["k"]
    jobs = planned_jobs(variant_override(tmp_path, speculative__k=shipped_k + 1))
    # serve_config writes the new serve.json; quantize is not planned
    assert set(jobs) == {"serve_config", *FROM_BAKE_ON}, jobs


@pytest.mark.e2e
def test_changing_the_recipe_reruns_quantize_and_after(tiny_run, tmp_path):
    recipe = ROOT / "results" / "test-recipe-copy.yaml"
    shutil.copy(ROOT / "recipes" / "awq-w4a16-g32-broad.yaml", recipe)
    try:
        jobs = planned_jobs(variant_override(tmp_path, recipe=str(recipe.relative_to(ROOT))))
    finally:
        recipe.unlink()
    assert set(jobs) == {"quantize", *FROM_BAKE_ON}, jobs


@pytest.mark.e2e
def test_a_new_gate_dataset_pin_refetches_the_gate_data_and_regates_only(tiny_run, tmp_path):
    override = tmp_path / "datasets.yaml"
    # pinned: a floating one would first need a lock entry (tools/lock.py add)
    override.write_text(yaml.safe_dump({"quality": {"datasets": {"org/not-loaded-by-any-task": "e" * 40}}}))
    jobs = planned_jobs(str(override))
    # the calibration set, the image and its measurements stay; the gate's data, the gate and the archive it admits
    assert set(jobs) == {"download_datasets", "quality_gate", "tarball"}, jobs
