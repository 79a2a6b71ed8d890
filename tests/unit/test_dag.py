"""DAG shape: lint, the rendered graph, and which stages a config change reruns."""

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FROM_BAKE_ON, ROOT, TINY, snakemake

STAGES = [
    "download",
    "download_datasets",
    "quantize",
    "bake_compile_cache",
    "build_image",
    "latency_probe",
    "quality_gate",
    "tarball",
    "verify_image",
]


def planned_jobs(*extra: str) -> dict[str, int]:
    """Jobs a dry run would run, from Snakemake's job-stats table."""
    out = snakemake("-n", "image.tar.gz", *TINY, *extra).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def test_lint_is_clean():
    for profile in ([], TINY):
        result = snakemake("--lint", *profile, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Lints for" not in result.stdout + result.stderr, result.stdout + result.stderr


# The rules as Snakemake parsed them (its API, in a fresh interpreter: loading a workflow sets process-wide state).
RULES_AS_PARSED = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(resource_settings=ResourceSettings(), snakefile=Path("Snakefile"), workdir=Path("."),
                            config_settings=ConfigSettings(configfiles=[Path(f) for f in sys.argv[1:]]))._workflow
    print(json.dumps([{"name": r.name, "file": r.snakefile, "target_only": r.norun, "checkpoint": r.is_checkpoint,
                       "log": [str(f) for f in r.log], "benchmark": str(r.benchmark) if r.benchmark else None}
                      for r in workflow.rules]))
"""


@functools.cache
def parsed_rules() -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", RULES_AS_PARSED, *TINY[1:]], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_rule_is_in_its_own_file():
    """rules/<name>.smk holds rule <name> and no other (`all`, which only gathers targets, is the Snakefile's)."""
    rules = parsed_rules()
    assert {rule["name"] for rule in rules} >= set(STAGES)
    misplaced = [
        f"{rule['name']} in {Path(rule['file']).relative_to(ROOT)}"
        for rule in rules
        if not rule["target_only"] and Path(rule["file"]) != ROOT / "rules" / f"{rule['name']}.smk"
    ]
    assert not misplaced, misplaced


def test_every_rule_has_a_log_and_a_benchmark_under_its_name():
    """logs/<rule>/... and benchmarks/<rule>/... for every rule that runs (`all` only gathers targets)."""
    rules = parsed_rules()
    listed = set(re.findall(r"^(\w+)", snakemake("--list-rules", *TINY).stdout, re.M))  # docstrings are indented
    assert {rule["name"] for rule in rules} == listed  # the API saw what the command line sees
    running = [rule for rule in rules if not rule["target_only"]]
    assert len(running) >= 12 and [r["name"] for r in rules if r["target_only"]] == ["all"]
    for rule in running:
        name = rule["name"]
        assert Path(rule["file"]).parent == ROOT / "rules", rule
        assert len(rule["log"]) == 1 and rule["log"][0].startswith(f"logs/{name}/"), rule
        assert rule["benchmark"] and rule["benchmark"].startswith(f"benchmarks/{name}/"), rule
        assert rule["benchmark"].endswith(".tsv"), rule
    checkpoints = {(Path(rule["file"]).name, rule["name"]) for rule in rules if rule["checkpoint"]}
    # select's walk reads the ranking and each visited candidate's checks (rules/select.smk); tarball reads select's
    assert checkpoints == {
        ("rank_candidates.smk", "rank_candidates"),
        ("select.smk", "select"),
        ("lossless.smk", "lossless"),
        ("quality_gate.smk", "quality_gate"),
    }
    included = set(re.findall(r'^include: "(rules/[^"]+)"', (ROOT / "Snakefile").read_text(), re.M))
    assert included == {f"rules/{p.name}" for p in (ROOT / "rules").glob("*.smk")}


def test_dag_renders_to_svg(tmp_path):
    if shutil.which("dot") is None:
        pytest.fail("graphviz `dot` is missing: run setup/install.sh")
    # the real profile selects by measurement (select.mode fastest): its gates wait for the ranking of the probes
    # (rules/select.smk), and verify_image for the choice
    measured = [*STAGES[: STAGES.index("latency_probe") + 1], "rank_candidates", "select", "tarball"]
    for profile, stages in (([], measured), (TINY, STAGES)):
        dag = snakemake(*profile, "--dag").stdout  # the default target; --dag takes an optional format
        svg = subprocess.run(["dot", "-Tsvg"], input=dag, capture_output=True, text=True, check=True).stdout
        assert "<svg" in svg
        for stage in stages:
            assert stage in svg, stage


def test_scripts_never_read_config():
    """Config reaches scripts only as params or input files, so Snakemake can track it for reruns."""
    for script in (ROOT / "scripts").glob("*.py"):
        assert "snakemake.config" not in script.read_text(), script


def test_scripts_survive_the_snakemake_preamble():
    """`script:` prepends a preamble, so a `from __future__` import there is a SyntaxError at run time."""
    for script in (ROOT / "scripts").glob("*.py"):
        assert "from __future__" not in script.read_text(), script


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
