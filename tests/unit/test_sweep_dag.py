"""The sweep's DAG: what each select mode plans, the walk of select's checks through Snakemake's checkpoints, the
SLURM and local profiles, and sweep config errors."""

import json
import re

import pytest
import yaml

from conftest import FROM_BAKE_ON, ROOT, TINY, _tiny_config, snakemake

SWEEP = [*TINY, "config/tiny-sweep.yaml"]
# the single-variant DAG's rules: what comes before the bake, and what image.tar.gz needs from the bake on
ORIGINAL_RULES = {
    "venv",
    "base_image",
    "download",
    "download_datasets",
    "train_tiny",
    "quantize",
    "serve_config",
    *FROM_BAKE_ON,
}


def forced_plan(*args: str) -> tuple[dict[str, int], set[str], str]:
    """A dry run of every job (-F, whatever is built already): job counts, variants named, the output."""
    out = snakemake("-n", "-F", *args).stdout
    table = out.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}
    return jobs, set(re.findall(r"variant=([\w.-]+)", out)), out


def test_fixed_selection_plans_the_one_variant_only():
    jobs, variants, _ = forced_plan("image.tar.gz", *TINY)
    assert set(jobs) == ORIGINAL_RULES, jobs
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    assert variants == {tiny["variant"]}
    assert jobs["quantize"] == 1 and jobs["latency_probe"] == 1


def test_fastest_selection_probes_every_candidate_and_checks_none_before_the_ranking():
    jobs, variants, out = forced_plan(*SWEEP)
    # CI's sweep: MTP K=2, DFlash K=3 and n-gram K=4, on one recipe
    assert variants == {"tiny-awq-mtp2", "tiny-awq-dflash3", "tiny-awq-ngram4"}
    assert jobs["download_draft"] == 1
    assert jobs["latency_probe"] == 3 and jobs["build_image"] == 3
    assert jobs["quantize"] == 1, "variants that differ only in speculation must share one quantize job"
    assert set(re.findall(r"recipe=([\w.-]+)", out)) == {"awq-w4a16-g32-broad"}
    assert jobs["rank_candidates"] == 1 and jobs["select"] == 1 and jobs["tarball"] == 1
    # the checks wait for the ranking: select asks for them one candidate at a time, fastest first
    assert not {"quality_gate", "lossless", "lossless_reference", "compare"} & set(jobs), jobs
    assert "checkpoint jobs" in out  # select's inputs, and tarball's variant, are known once the ranking is


def test_the_real_profile_probes_every_candidate_and_gates_none_before_the_ranking():
    """config.yaml's default: select.mode fastest over select.candidates. A dry run plans each candidate's chain up
    to its latency probe and the ranking; no quality gate (hours a variant) and no lossless check yet."""
    real = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert real["select"]["mode"] == "fastest" and len(real["select"]["candidates"]) >= 2
    jobs, variants, out = forced_plan()
    assert variants == set(real["select"]["candidates"])
    assert jobs["latency_probe"] == jobs["build_image"] == len(real["select"]["candidates"])
    assert jobs["rank_candidates"] == 1 and jobs["select"] == 1
    assert not {"quality_gate", "lossless", "lossless_reference", "compare"} & set(jobs), jobs


def test_a_fixed_variant_in_the_real_profile_builds_that_variant_only():
    real = yaml.safe_load((ROOT / "config.yaml").read_text())
    jobs, variants, _ = forced_plan("image.tar.gz", "--config", "select={mode: fixed}")
    assert variants == {real["variant"]}
    assert jobs["latency_probe"] == 1 and jobs["quality_gate"] == 1 and jobs["lossless"] == 1
    assert not {"rank_candidates", "select"} & set(jobs)


def test_every_job_declares_runtime_and_memory():
    _, _, out = forced_plan(*SWEEP)
    seen = set()
    for match in re.finditer(r"^(?:rule|checkpoint) (\w+):$.*?^\s+resources: (.*?)$", out, re.M | re.S):
        name, resources = match.groups()
        seen.add(name)
        if name != "all":
            assert "runtime=" in resources and "mem_mb=" in resources, (name, resources)
    assert {"quantize", "latency_probe", "rank_candidates", "select", "tarball"} <= seen


def test_slurm_profile_dry_runs_the_sweep():
    result = snakemake("-n", "-F", "--profile", "profiles/slurm", *SWEEP)  # -F: whatever is built here already
    out = result.stdout + result.stderr
    assert "Group job serve" in out  # each variant's serving chain is one cluster job on one node
    assert "slurm_extra=--exclusive" in out
    jobs = out.split("Job stats:", 1)[1]
    for rule in ("rank_candidates", "select", "quantize", "latency_probe"):
        assert re.search(rf"^{rule}\s+\d+$", jobs, re.M), rule


def test_local_profile_dry_runs_the_sweep():
    out = snakemake("-n", "-F", "--profile", "profiles/local", *SWEEP).stdout
    assert "host_share=100" in out  # the probe's share: it runs alone


def test_lint_is_clean_for_the_sweep():
    result = snakemake("--lint", *SWEEP, check=False)
    assert result.returncode == 0 and "Lints for" not in result.stdout + result.stderr, result.stdout + result.stderr


def dry_run_with(tmp_path, overlay: dict, *extra: str):
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return snakemake("-n", *TINY, *extra, str(path), check=False)


# A bad config overlay and the words its refusal must contain.
SWEEP_REFUSALS = [
    (
        {"sweeps": {"tiny-k": {"prefix": "tiny-awq", "base": "tiny-awq-mtp1", "axes": {"speculative.k": [-1]}}}},
        "config key 'variants.tiny-awq-mtp-1.speculative.k': -1 is less than the minimum of 0 (variant generated by "
        "sweep 'tiny-k')",
    ),
    (
        {"sweeps": {"tiny-k": {"prefix": "tiny-awq", "base": "tiny-awq-mtp1", "axes": {"speculative.k": [0]}}}},
        "config key 'variants.tiny-awq-mtp0.speculative.k': method mtp needs k >= 1, got 0 "
        "(variant generated by sweep 'tiny-k')",
    ),
    (
        {"sweeps": {"s": {"base": "tiny-awq-mtp1", "axes": {"serve.max_num_sqs": [1]}}}},
        "config key 'variants.s-max-num-sqs1.serve.max_num_sqs': unknown key (variant generated by sweep 's')",
    ),
    (
        {"sweeps": {"s": {"base": "missing", "axes": {"speculative.k": [1]}}}},
        "config key 'sweeps.s.base': 'missing' is not a catalog variant",
    ),
    ({"sweeps": {"s": {"base": "tiny-awq-mtp1", "axes": {"model.name": [1]}}}}, "config key 'sweeps.s.axes'"),
    (
        {
            "sweeps": {
                "s": {
                    "prefix": "tiny",
                    "base": "tiny-awq-mtp1",
                    "axes": {"recipe": {"gptq-mtp1": "recipes/bf16.yaml"}},
                }
            }
        },
        "generates variant 'tiny-gptq-mtp1' with settings other than the 'tiny-gptq-mtp1' of variants:",
    ),
    ({"compare": {"variants": ["tiny-k", "nope"]}}, "config key 'compare.variants[1]': 'nope' is neither"),
    (
        {"select": {"mode": "fastest", "candidates": ["tiny-k", "tiny-awq-none", "nope"]}},
        "config key 'select.candidates[2]': 'nope' is neither a variant nor a sweep",
    ),
    ({"select": {"mode": "fastest", "candidates": []}}, "config key 'select.candidates': [] should be non-empty"),
    ({"compare": {"reference": "tiny-gptq-mtp1"}}, "config key 'compare.reference'"),
    ({"select": {"mode": "fastest", "variant": "tiny-bf16-mtp1"}}, "config key 'select.variant': only read with"),
    ({"select": {"variant": "nope"}}, "config key 'select.variant': 'nope' is not one of the variants"),
    ({"variants": {"quantize": {"recipe": "recipes/bf16.yaml"}}}, "'quantize' is reserved"),
]


@pytest.mark.parametrize("overlay, words", SWEEP_REFUSALS)
def test_bad_sweep_config_is_refused_naming_the_key(overlay, words):
    """What rules/common.smk loads: config/tiny.yaml with the overlay merged in as --configfile merges it (one case
    also through snakemake itself, below)."""
    from snakemake.utils import update_config

    from lib.dag import config as pipeline_config

    config = _tiny_config()
    update_config(config, overlay)
    with pytest.raises(pipeline_config.ConfigError) as caught:
        pipeline_config.load(config)
    assert words in str(caught.value)


def test_snakemake_refuses_a_bad_sweep_before_planning(tmp_path):
    overlay, words = SWEEP_REFUSALS[1]  # K=0 for MTP
    result = dry_run_with(tmp_path, overlay)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and words in out, out[-3000:]
    assert "Job stats" not in out


def test_fixed_variant_from_select(tmp_path):
    """select.variant names the image's variant in mode fixed, and nothing else is planned."""
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump({"select": {"variant": "tiny-bf16-mtp1"}}))
    _, variants, _ = forced_plan("image.tar.gz", *TINY, str(path))
    assert variants == {"tiny-bf16-mtp1"}


# rules/rank_candidates.smk and rules/select.smk on their own, with stand-ins for the two checks: each copies a
# prepared record and notes its call, so a real Snakemake run shows which checks the walk asks for and in what order
# (no image, no server: seconds).
WALK_SNAKEFILE = """
import json, sys
from pathlib import Path

sys.path.insert(0, config["scripts"])
from lib.dag import selection

CANDIDATES = config["candidates"]
BF16_REFERENCE = config.get("bf16_reference")
RESOURCES = {name: {"mem_mb": 100, "runtime": 1} for name in ("rank_candidates", "select")}


def code_of(script):  # rules/common.smk's: the modules a script imports (none needed by the stand-ins)
    return []


checkpoint lossless:
    output:
        "results/{variant}/lossless/lossless.json",
    shell:
        "echo lossless {wildcards.variant} >> checks.txt && cp records/{wildcards.variant}.lossless.json {output}"


checkpoint quality_gate:
    output:
        "results/{variant}/quality_gate/quality.json",
    shell:
        "echo quality_gate {wildcards.variant} >> checks.txt && cp records/{wildcards.variant}.quality.json {output}"


include: config["rank_rules"]
include: config["select_rules"]
"""


def walk_workflow(tmp_path, outcomes: dict[str, tuple[bool, bool]], latencies=None, bf16=None):
    """A workdir with the stand-in workflow, the candidates' latency records (test_sweeps' by default) and each one's
    (lossless passed, gate passed) records, and `bf16` (name, latency record): the run's same-host bf16 variant;
    returns a function running snakemake there."""
    from unit.test_sweeps import LATENCIES, lossless_record, quality

    latencies = latencies or LATENCIES
    (tmp_path / "Snakefile").write_text(WALK_SNAKEFILE)
    (tmp_path / "schemas").symlink_to(ROOT / "schemas")
    (tmp_path / "records").mkdir()
    if bf16:
        path = tmp_path / "results" / bf16[0] / "latency_probe" / "latency.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(bf16[1]))
    for variant, record in latencies.items():
        path = tmp_path / "results" / variant / "latency_probe" / "latency.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(record))
        passed_lossless, passed_gate = outcomes[variant]
        (tmp_path / "records" / f"{variant}.lossless.json").write_text(
            json.dumps(lossless_record(variant, passed_lossless))
        )
        (tmp_path / "records" / f"{variant}.quality.json").write_text(json.dumps(quality(0.9 if passed_gate else 0.05)))
    settings = {
        "scripts": str(ROOT / "scripts"),
        "rank_rules": str(ROOT / "rules" / "rank_candidates.smk"),
        "select_rules": str(ROOT / "rules" / "select.smk"),
        "candidates": sorted(latencies),
        "select": {"by": "mean_speedup"},
        "bf16_reference": bf16[0] if bf16 else None,
    }
    (tmp_path / "config.json").write_text(json.dumps(settings))
    return lambda *args, check=True: snakemake(*args, "--configfile", "config.json", cwd=tmp_path, check=check)


def test_snakemake_walks_the_candidates_one_check_at_a_time_and_stops_at_the_winner(tmp_path):
    run = walk_workflow(tmp_path, {"a": (False, True), "b": (True, False), "c": (True, True), "d": (True, True)})
    planned = run("-n", "results/selection.json").stdout
    assert "checkpoint rank_candidates:" in planned
    assert "checkpoint lossless:" not in planned and "checkpoint quality_gate:" not in planned  # not before the ranking
    run("--cores", "2", "results/selection.json")
    # fastest first: a is lossy (never gated), b fails the gate, c passes both; d, slower, is never checked
    assert (tmp_path / "checks.txt").read_text().split("\n")[:-1] == [
        "lossless a",
        "lossless b",
        "quality_gate b",
        "lossless c",
        "quality_gate c",
    ]
    assert not (tmp_path / "results" / "d" / "lossless").exists()
    assert not (tmp_path / "results" / "d" / "quality_gate").exists()
    chosen = json.loads((tmp_path / "results" / "selection.json").read_text())
    assert chosen["variant"] == "c"
    assert [(c["variant"], c["outcome"], c["failed_check"]) for c in chosen["candidates"]] == [
        ("a", "failed", "lossless"),
        ("b", "failed", "quality_gate"),
        ("c", "won", None),
        ("d", "not_gated", None),
    ]
    assert json.loads((tmp_path / "results" / "ranking.json").read_text())["candidates"][0]["variant"] == "a"
    assert "Nothing to be done" in run("-n", "results/selection.json").stdout


def test_the_ranking_rule_reads_the_same_host_bf16_record_as_an_input(tmp_path):
    """rank_candidates divides by the run's bf16 variant's medians: its latency record is an input of the rule, and the
    ranking follows this host's speeds, not the contract's A10G numbers."""
    from unit.test_sweeps import BF16_MEDIANS, X_MEDIANS, Y_MEDIANS, latency, with_medians

    candidates = {"x": with_medians(latency(1.0, None), X_MEDIANS), "y": with_medians(latency(1.0, None), Y_MEDIANS)}
    bf16 = ("bf16-none", with_medians(latency(1.0, None), BF16_MEDIANS))
    run = walk_workflow(tmp_path, {"x": (True, True), "y": (True, True)}, candidates, bf16)
    run("--cores", "1", "results/ranking.json")
    ranking = json.loads((tmp_path / "results" / "ranking.json").read_text())
    assert [row["variant"] for row in ranking["candidates"]] == ["y", "x"]
    assert ranking["baseline"]["kind"] == "same_host_bf16" and ranking["baseline"]["variant"] == "bf16-none"
    (tmp_path / "results" / "bf16-none" / "latency_probe" / "latency.json").unlink()
    missing = run("-n", "-F", "results/ranking.json", check=False)  # without the bf16 record, no ranking
    assert missing.returncode != 0 and "results/bf16-none/latency_probe/latency.json" in missing.stderr + missing.stdout


def test_snakemake_fails_select_when_every_candidate_fails(tmp_path):
    run = walk_workflow(tmp_path, {"a": (False, True), "b": (True, False), "c": (False, True), "d": (True, False)})
    result = run("--cores", "2", "results/selection.json", check=False)
    assert result.returncode != 0 and "Error in rule select" in result.stdout + result.stderr
    log = (tmp_path / "logs" / "select" / "select.log").read_text()
    assert "no candidate passes the lossless check and the quality gate" in log, log[-3000:]
    assert "a (rank 1): failed the lossless check" in log and "b (rank 2): failed the quality gate" in log
    assert "d (rank 4): failed the quality gate: mc 0.05 < 0.1" in log
    assert (tmp_path / "checks.txt").read_text().split() == (
        "lossless a lossless b quality_gate b lossless c lossless d quality_gate d".split()
    )
    assert not (tmp_path / "results" / "selection.json").exists()
