"""Which stages a config change reruns once the tiny DAG has run: a changed K, recipe or gate dataset pin reruns
exactly the stages it reaches (tests/unit/test_dag.py: the DAG's shape)."""

import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import FROM_BAKE_ON, ROOT, TINY, snakemake, with_recipe
from lib.dag.sweeps import k_label


def planned_jobs(*extra: str) -> dict[str, int]:
    """Jobs a dry run would run, from Snakemake's job-stats table."""
    out = snakemake("-n", "image.tar.gz", *TINY, *extra).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def override(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.e2e
def test_changing_k_reruns_bake_and_after_only(tiny_run, tmp_path):
    assert planned_jobs() == {}
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variant = tiny["variants"][tiny["variant"]]
    method, shipped_k = variant["speculative"]["method"], variant["speculative"]["k"]
    variant["speculative"]["k"] = shipped_k + 1
    # a name gives its K (lib.dag.config name_problems): the new K is a variant of its own on the same recipe
    name = tiny["variant"].replace(k_label(method, shipped_k), k_label(method, shipped_k + 1))
    assert name != tiny["variant"]
    jobs = planned_jobs(override(tmp_path, {"variant": name, "variants": {name: variant}}))
    # serve_config writes the new serve.json; quantize is not planned
    assert set(jobs) == {"serve_config", *FROM_BAKE_ON}, jobs


@pytest.mark.e2e
def test_changing_the_recipe_reruns_quantize_and_after(tiny_run, tmp_path):
    recipe = ROOT / "results" / "test-recipe-copy.yaml"
    shutil.copy(ROOT / "recipes" / "awq-w4a16-g32-broad.yaml", recipe)
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variants = with_recipe(tiny, str(recipe.relative_to(ROOT)))["variants"]
    try:
        jobs = planned_jobs(override(tmp_path, {"variants": variants}))
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
