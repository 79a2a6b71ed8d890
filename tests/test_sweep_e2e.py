"""The tiny sweep, run as the README says: AWQ W4A16 with MTP K in {1, 2}, compared, checked lossless, the fastest
shipped.

It reuses the default run's outputs (tiny-awq-mtp2, its quantized checkpoint and its lossless reference are sweep
points), so it builds and measures one more variant, K=1. Its image comes from the session's background build
(BACKGROUND_TARGETS), which makes it beside the modules that run before the whole DAG; the sweep itself probes,
gates and checks it with nothing else running. It replaces image.tar.gz with the selected variant's (when K=1
wins), so conftest runs it last.
"""

import json

import pytest

from conftest import ROOT, TINY_SWEEP, snakemake
from lib.stage import validate_json

pytestmark = pytest.mark.e2e

SWEEP = TINY_SWEEP  # the sweep runs once, in conftest's session fixture tiny_sweep
VARIANTS = {"tiny-awq-mtp1", "tiny-awq-mtp2"}
# K=1's bake and image: a catalog variant of config/tiny.yaml, the same outputs with the sweep's config added.
BACKGROUND_TARGETS = ["results/tiny-awq-mtp1/build_image/image.json"]
RESULTS = ROOT / "results"


def test_summary_covers_every_variant_with_both_speedups(tiny_sweep):
    summary = json.loads((RESULTS / "summary.json").read_text())
    validate_json(summary, ROOT / "schemas" / "summary.schema.yaml")
    rows = {row["variant"]: row for row in summary["variants"]}
    assert set(rows) == VARIANTS
    assert all(row["weight_bits"] == 4 for row in rows.values())
    for row in rows.values():
        assert row["mean_speedup_vs_baseline"] > 0
    assert rows["tiny-awq-mtp1"]["mean_acceptance_length"] > 1.5  # the trained MTP head accepts
    assert rows["tiny-awq-mtp2"]["mean_acceptance_length"] > rows["tiny-awq-mtp1"]["mean_acceptance_length"]
    assert [row["speculative"]["k"] for row in (rows["tiny-awq-mtp1"], rows["tiny-awq-mtp2"])] == [1, 2]
    csv_header = (RESULTS / "summary.csv").read_text().splitlines()[0]
    assert "short_speedup_vs_baseline" in csv_header
    table = (RESULTS / "summary.md").read_text()
    assert all(f"| {name} |" in table for name in VARIANTS)
    for plot in ("speedup_vs_quality", "latency_per_category", "k_sweep"):
        assert (RESULTS / "plots" / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"
    for name in VARIANTS:
        assert (RESULTS / name / "latency_probe" / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_mtp_is_lossless_against_the_same_weights_without_speculation(tiny_sweep):
    """Greedy ids of every prompt set and category equal those of the same weights and serve settings with
    speculation off (near ties allowed): one reference run, the default tiny-awq-mtp2's image, serves both K."""
    for name in ("tiny-awq-mtp2", "tiny-awq-mtp1"):
        record = json.loads((RESULTS / name / "lossless" / "lossless.json").read_text())
        validate_json(record, ROOT / "schemas" / "lossless.schema.yaml")
        assert record["passed"] and record["reference"].endswith("speculation off"), record
        assert {row["set"] for row in record["rows"]} == {"repeated", "fresh"}  # config/tiny.yaml's probe.sets
        assert all(row["tokens"] for row in record["rows"])
    assert not (RESULTS / "tiny-awq-mtp1" / "lossless" / "reference.json").exists()


def test_variants_share_the_quantized_checkpoint_of_their_recipe(tiny_sweep):
    assert {p.name for p in (RESULTS / "quantize").iterdir()} >= {"awq-w4a16-g32-broad"}
    assert not any((RESULTS / name / "quantize").exists() for name in VARIANTS)


def test_the_selected_variant_is_the_image(tiny_sweep):
    selection = json.loads((RESULTS / "selection.json").read_text())
    validate_json(selection, ROOT / "schemas" / "selection.schema.yaml")
    summary = json.loads((RESULTS / "summary.json").read_text())
    lossless = {
        row["variant"]: json.loads((RESULTS / row["variant"] / "lossless" / "lossless.json").read_text())["passed"]
        for row in summary["variants"]
    }
    passing = [row for row in summary["variants"] if row["gate_passed"] and lossless[row["variant"]]]
    fastest = max(passing, key=lambda row: row["mean_speedup_vs_baseline"])
    assert selection["variant"] == fastest["variant"] and "fastest by mean_speedup" in selection["reason"]
    verify = json.loads((RESULTS / selection["variant"] / "verify_image" / "verify.json").read_text())
    assert [tag.rsplit(":", 1)[1] for tag in verify["repo_tags"]] == [selection["variant"]]  # the tag is the variant
    digest = (ROOT / "image.tar.gz.sha256").read_text().split()[0]
    assert verify["archive_sha256"] == digest


def test_sweep_is_up_to_date_and_in_the_report(tiny_sweep, tmp_path):
    assert "Nothing to be done" in snakemake("-n", *SWEEP).stdout
    html = tmp_path / "report.html"
    snakemake("--report", str(html), *SWEEP)
    text = html.read_text()
    for needle in (
        "Comparison",
        "summary.json",
        "speedup_vs_quality.png",
        "k_sweep.png",
        "Selection",
        "selection.json",
        "latency.png",
    ):
        assert needle in text, needle
