"""The whole tiny DAG, run as the README's first command runs it, and what it leaves behind."""

import hashlib
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY as TINY_ARGS, snakemake
from lib.stage import validate_json

pytestmark = pytest.mark.e2e

TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
VARIANT = TINY["variant"]
RESULTS = ROOT / "results" / VARIANT
QUANTIZED = ROOT / "results" / "quantize" / Path(TINY["variants"][VARIANT]["recipe"]).stem  # one per recipe


def test_tiny_run_ends_in_a_checked_image_tarball(tiny_run):
    tarball = ROOT / "image.tar.gz"
    digest, name = (ROOT / "image.tar.gz.sha256").read_text().split()
    assert name == "image.tar.gz"
    assert hashlib.sha256(tarball.read_bytes()).hexdigest() == digest
    assert tarball.stat().st_size < TINY["image"].get("max_size_gb", 20) * 1e9


def test_every_stage_left_its_schema_valid_record(tiny_run):
    download = json.loads((ROOT / "weights" / TINY["model"]["name"] / "download.json").read_text())
    validate_json(download, ROOT / "schemas" / "download.schema.yaml")
    training = download["training"]  # the tiny model is trained: its gate measures a model, not chance
    assert training["steps"] == TINY["model"]["tiny"]["train"]["steps"] > 0
    # the loss also counts made-up repeated sentences, whose first occurrence no model can predict (8.0 -> 1.1 seen)
    assert training["final_loss"] < training["first_loss"] / 4 and training["seconds"] > 0
    assert training["heldout_answer_token_accuracy"] > 0.9
    latency = json.loads((RESULTS / "latency_probe" / "latency.json").read_text())
    validate_json(latency, ROOT / "schemas" / "latency.schema.yaml")
    assert [c["name"] for c in latency["categories"]] == ["short", "medium", "long"]
    assert all(c["runs"] == TINY["probe"]["runs"] for c in latency["categories"])
    # the image's start loaded what the bake compiled, and said so (image.require_cache_hit: the probe fails if not)
    compile_cache = latency["compile_cache"]
    assert compile_cache["hit"] and compile_cache["evidence"] and not compile_cache["load_failures"]
    assert latency["device_bandwidth"]["device"] == "cpu" and latency["device_bandwidth"]["gbps"] > 0  # tiny: no GPU
    # its speedups are against the contract's A10G baseline_ms, and the record says so, with the long category's size
    baseline = latency["baseline"]
    assert baseline["kind"] == "contract_a10g" and baseline["device"] == "cpu"
    assert [(d["name"], d["prompt_tokens"], d["contract_prompt_tokens"]) for d in baseline["sizes_differ"]] == [
        ("long", 4096, 8192)
    ]
    assert latency["prompt_sets"] == TINY["probe"]["sets"] == ["repeated", "fresh"] and latency["varied"] is None
    all_sets = latency["categories"] + latency["fresh"]["categories"]
    assert [c["name"] for c in latency["fresh"]["categories"]] == ["short", "medium", "long"]
    # the default variant speculates with MTP: vLLM's counters must have seen draft rounds
    assert all(c["mean_acceptance_length"] >= 1 for c in all_sets)
    # greedy output ids of every category's first timed run, one per generated token (the lossless check reads them)
    assert all(len(c["first_run_token_ids"]) == c["output_tokens_requested"] for c in all_sets)
    assert all(c["prefix_cache"]["hits"] == 0 for c in latency["fresh"]["categories"])  # fresh: nothing to reuse
    quality = json.loads((RESULTS / "quality_gate" / "quality.json").read_text())
    validate_json(quality, ROOT / "schemas" / "quality.schema.yaml")
    assert quality["passed"] is True
    assert {t["name"] for t in quality["tasks"]} == {t["name"] for t in TINY["quality"]["tasks"]}
    coldstart = json.loads((RESULTS / "bake_compile_cache" / "coldstart.json").read_text())
    validate_json(coldstart, ROOT / "schemas" / "coldstart.schema.yaml")
    assert coldstart["cold_start_empty_cache_s"] > 0 and coldstart["cache_files"] > 0
    # the bake's answers to Inductor's CPU instruction-set probes ship in the cache, readable by the image's server
    # user (serving/patches/aot_load_fix.py): a start of the image does not build and load the probe libraries again
    with tarfile.open(RESULTS / "bake_compile_cache" / "compile_cache.tar") as cache:
        member = cache.getmember("isa-probes/isa_probes.json")
        probes = json.load(cache.extractfile(member))
    assert member.mode & 0o044 == 0o044 and probes and set(map(type, probes.values())) == {bool}
    serve = json.loads((RESULTS / "serve_config" / "serve.json").read_text())
    assert serve["speculative"] == {"method": "mtp", "k": TINY["variants"][VARIANT]["speculative"]["k"]}


def test_manifests_match_the_files(tiny_run):
    from lib.stage import checkpoint_files, sha256_file

    for folder, manifest in [
        (
            ROOT / "weights" / TINY["model"]["name"] / "checkpoint",
            ROOT / "weights" / TINY["model"]["name"] / "manifest.json",
        ),
        (QUANTIZED / "model", QUANTIZED / "manifest.json"),
    ]:
        recorded = json.loads(manifest.read_text())
        files = {str(p.relative_to(folder)) for p in checkpoint_files(folder)}
        assert set(recorded) == files
        for relpath, digest in recorded.items():
            assert sha256_file(folder / relpath) == digest, relpath


def test_gate_with_teeth_fails_and_stops_its_container(tiny_run, tmp_path):
    """The same gate against the same image, with thresholds no model meets: recorded as failed (passed: false, the
    record select skips and tarball refuses), a table naming every task, and no container left running."""
    tasks = [dict(task, threshold=1.01) for task in TINY["quality"]["tasks"]]  # the trained model scores 1.0 on some
    job = {
        "rule": "quality_gate",
        "input": {
            "image": str(RESULTS / "build_image" / "image.json"),
            "datasets_cache": str(ROOT / "datasets" / "gate" / "cache"),
            "datasets_manifest": str(ROOT / "datasets" / "gate" / "manifest.json"),
        },
        "output": {"scores": str(tmp_path / "quality.json")},
        "params": {
            "model_name": "Qwen/Qwen3.5-4B",
            "tasks": tasks,
            "limit": 4,
            "num_concurrent": 4,
            "tasks_dir": str(ROOT / TINY["quality"]["tasks_dir"]),
            "gpus": False,
            "shm_size": "1g",
            "ping_timeout_s": 900,
            "reference_variant": None,
            "reference_scores": None,
            "margin_stderr": 0,
        },
        "log": [str(tmp_path / "gate.log")],
        "threads": 1,
        "wildcards": {"variant": VARIANT},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    result = subprocess.run(
        [
            str(ROOT / ".venvs" / "eval" / "bin" / "python"),
            str(ROOT / "scripts" / "quality_gate.py"),
            "--job",
            str(tmp_path / "job.json"),
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "the gate failed" in output and "recorded as passed: false" in output
    for task in tasks:
        assert task["name"] in output
    assert json.loads((tmp_path / "quality.json").read_text())["passed"] is False
    assert json.loads((tmp_path / "gate.scores.json").read_text())["passed"] is False
    running = subprocess.run(["docker", "ps", "-q", "--filter", "name=quality-gate"], capture_output=True, text=True)
    assert running.stdout.strip() == ""


def test_report_gathers_the_measurements(tiny_run, tmp_path):
    html = tmp_path / "report.html"
    snakemake("--report", str(html), *TINY_ARGS)
    text = html.read_text()
    for category, record in [
        ("Latency", "latency.json"),
        ("Quality gate", "quality.json"),
        ("Cold start", "coldstart.json"),
        ("Quantization", "report.json"),
        ("Image", "verify.json"),
    ]:
        assert category in text and record in text, category


def test_build_image_finds_the_base_in_buildahs_store(tiny_run):
    """With Docker as the builder and a reproducible build, base_image copies the base into buildah's store, so
    build_image does not; with any other pair there is no copy to make and none is recorded."""
    base = json.loads((ROOT / "results" / "base_image" / "image.json").read_text())
    built = json.loads((RESULTS / "build_image" / "image.json").read_text())
    assert built["base"]["id"] == base["id"]
    copies = base["builder"] == "docker" and built["reproducible"]
    assert bool(base["buildah_copy"]) == copies, (base, built["reproducible"])
    log = (ROOT / "logs" / "build_image" / f"{VARIANT}.log").read_text()
    assert "from Docker to buildah" not in log, log[-2000:]
