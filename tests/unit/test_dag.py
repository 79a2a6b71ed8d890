"""DAG shape: lint, one file per rule, each rule's log and benchmark, the rendered graph, scripts that read no config
(tests/e2e/test_dag.py: which stages a config change reruns)."""

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY, snakemake

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
