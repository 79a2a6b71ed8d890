"""Sweeps expand into named variants; compare summarises them; select picks the fastest that passes (pure parts)."""

import copy
import json

import pytest

import compare
import select_variant
from lib import sweeps
import tarball
from lib.stage import StageError, validate_json
from conftest import ROOT

BASE = {"recipe": "recipes/awq-w4a16-g32-broad.yaml", "serve": {"max_num_seqs": 8, "dtype": "bfloat16"},
        "speculative": {"method": "mtp", "k": 1}}


def fill(name, point, sweep):
    """Stand-in for the schema's filling: the points here are complete already."""
    return point


def test_axes_expand_to_self_explaining_names():
    variants, members, origin = sweeps.expand({"base": BASE}, {"s": {
        "prefix": "tiny", "base": "base",
        "axes": {"recipe": ["recipes/bf16.yaml", "recipes/w8a16.yaml"], "speculative.k": [2, 3],
                 "serve.max_num_seqs": [1, 4]}}}, fill)
    assert members["s"][:3] == ["tiny-bf16-k2-seqs1", "tiny-bf16-k2-seqs4", "tiny-bf16-k3-seqs1"]
    assert len(members["s"]) == 8 and set(origin) == set(members["s"])
    point = variants["tiny-w8a16-k3-seqs4"]
    assert point["recipe"] == "recipes/w8a16.yaml" and point["speculative"] == {"method": "mtp", "k": 3}
    assert point["serve"] == {"max_num_seqs": 4, "dtype": "bfloat16"}
    assert variants["base"] == BASE  # the base is not touched


def test_mapping_labels_and_prefixes():
    _, members, _ = sweeps.expand({"base": BASE}, {
        "bits": {"prefix": "", "base": "base", "axes": {"recipe": {"bf16": "recipes/bf16.yaml", "int4": "recipes/x.yaml"}}},
        "named": {"base": "base", "axes": {"speculative.k": [2]}}}, fill)
    assert members == {"bits": ["bf16", "int4"], "named": ["named-k2"]}


def test_a_point_with_a_catalog_variants_settings_is_that_variant():
    catalog = {"tiny-awq-mtp1": BASE, "tiny-bf16-mtp1": dict(BASE, recipe="recipes/bf16.yaml")}
    variants, members, origin = sweeps.expand(catalog, {
        "tiny-bits": {"prefix": "tiny", "base": "tiny-awq-mtp1",
                      "axes": {"recipe": {"bf16": "recipes/bf16.yaml", "awq": BASE["recipe"]}}},
        "tiny-k": {"prefix": "tiny-awq", "base": "tiny-awq-mtp1", "axes": {"speculative.k": [1, 2]}}}, fill)
    assert members == {"tiny-bits": ["tiny-bf16-mtp1", "tiny-awq-mtp1"], "tiny-k": ["tiny-awq-mtp1", "tiny-awq-k2"]}
    assert set(variants) == {"tiny-awq-mtp1", "tiny-bf16-mtp1", "tiny-awq-k2"} and origin == {"tiny-awq-k2": "tiny-k"}


def test_a_point_named_like_a_catalog_variant_with_other_settings_is_an_error():
    catalog = {"base": BASE, "x-k2": dict(BASE, recipe="recipes/bf16.yaml")}
    with pytest.raises(sweeps.SweepError, match=r"sweeps\.s'.*generates variant 'x-k2' with settings other than"):
        sweeps.expand(catalog, {"s": {"prefix": "x", "base": "base", "axes": {"speculative.k": [2]}}}, fill)


def test_two_points_with_one_name_are_an_error():
    with pytest.raises(sweeps.SweepError, match="sweep 's'"):
        sweeps.expand({"base": BASE}, {"s": {"base": "base", "axes": {
            "recipe": ["recipes/a.yaml", "other/a.yaml"]}}}, fill)


@pytest.mark.parametrize("spec, words", [
    ({"base": "nope", "axes": {"speculative.k": [1]}}, "sweeps.s.base': 'nope' is not a catalog variant"),
    ({"base": "base", "axes": {"model.name": [1]}}, "sweeps.s.axes.model.name': an axis is"),
    ({"base": "base", "axes": {"speculative.k": []}}, "non-empty list"),
    ({"base": "base", "axes": {"speculative.k": {"K 2": 2}}}, "label 'K 2' must match"),
])
def test_bad_sweeps_name_the_key(spec, words):
    with pytest.raises(sweeps.SweepError, match=None) as error:
        sweeps.expand({"base": BASE}, {"s": spec}, fill)
    assert words in str(error.value)


def test_compared_variants_resolve_sweeps_and_names():
    members = {"a": ["v1", "v2"], "b": ["v2", "v3"]}
    variants = {"v0": {}, "v1": {}, "v2": {}, "v3": {}}
    assert sweeps.compared(None, "v0", variants, members) == ["v0", "v1", "v2", "v3"]
    assert sweeps.compared(["b", "v1"], "v0", variants, members) == ["v2", "v3", "v1"]
    with pytest.raises(sweeps.SweepError, match="'zzz' is neither a variant nor a sweep"):
        sweeps.compared(["zzz"], "v0", variants, members)


# ---- compare and select on fabricated records ----

CATEGORIES = [("short", 2582.0), ("medium", 5441.0), ("long", 6576.0)]


def latency(scale: float, acceptance: float | None) -> dict:
    def categories(factor):
        return [{"name": name, "prompt_tokens": 64, "output_tokens_requested": 8, "output_tokens_mean": 8, "runs": 3,
                 "median_ms": base * scale * factor, "p90_ms": base * scale * factor * 1.1, "p99_ms": base * scale * 1.2,
                 "ttft_median_ms": 10.0, "itl_median_ms": 2.0, "baseline_ms": base, "speedup": 1 / (scale * factor),
                 "latencies_ms": [base * scale], "mean_acceptance_length": acceptance} for name, base in CATEGORIES]
    return {"categories": categories(1.0), "mean_speedup": 1 / scale, "varied": {"categories": categories(1.2),
                                                                                 "mean_speedup": 1 / (scale * 1.2)}}


def quality(score: float, threshold: float = 0.1) -> dict:
    return {"passed": score >= threshold, "image": "x", "tasks": [
        {"name": "mc", "score": score, "threshold": threshold, "passed": score >= threshold},
        {"name": "ifeval", "score": 0.5, "threshold": 0.0, "passed": True}]}


QUANTIZE = {"bf16": {"quantized": False, "output_bytes": 800, "recipe": {"groups": []}},
            "awq-w4a16-g32-broad": {"quantized": True, "output_bytes": 300,
                                    "recipe": {"groups": [{"weights": {"num_bits": 4}}]}}}


def variant(name, key, k, seqs=8):
    return {"name": name, "recipe": f"recipes/{key}.yaml", "recipe_key": key,
            "serve": {"max_num_seqs": seqs}, "speculative": {"method": "mtp", "k": k}}


def fabricated_summary():
    variants = [variant("bf16-k1", "bf16", 1), variant("awq-k1", "awq-w4a16-g32-broad", 1),
                variant("awq-k2", "awq-w4a16-g32-broad", 2), variant("awq-k2-bad", "awq-w4a16-g32-broad", 2, seqs=4)]
    latencies = [latency(1.0, 1.5), latency(0.5, 1.5), latency(0.4, 2.0), latency(0.1, 2.0)]
    qualities = [quality(0.9), quality(0.7), quality(0.6), quality(0.05)]
    return compare.build_summary(variants, latencies, qualities, QUANTIZE, None)


def test_summary_speedups_reference_and_pareto():
    summary = fabricated_summary()
    validate_json(summary, ROOT / "schemas" / "summary.schema.yaml")
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["awq-k1"]["weight_bits"] == 4 and rows["bf16-k1"]["weight_bits"] == 16
    # same serving as bf16-k1: it is the reference; awq-k2 has no bf16 twin, so the first bf16 variant is used
    assert rows["awq-k1"]["reference"] == "bf16-k1" and rows["awq-k2"]["reference"] == "bf16-k1"
    assert rows["awq-k1"]["latency"]["short"]["speedup_vs_reference"] == pytest.approx(2.0)
    assert rows["awq-k1"]["mean_speedup_vs_reference"] == pytest.approx(2.0)
    assert rows["bf16-k1"]["mean_speedup_vs_reference"] == pytest.approx(1.0)
    assert rows["awq-k2"]["mean_speedup_vs_baseline"] == pytest.approx(2.5)
    # every point trades quality for speed except none: all four are on the mc front
    assert all(r["pareto"]["mc"] for r in rows.values())
    # ifeval ties at 0.5: only the fastest is on its front
    assert [n for n, r in rows.items() if r["pareto"]["ifeval"]] == ["awq-k2-bad"]
    assert rows["awq-k2-bad"]["gate_passed"] is False and rows["awq-k2-bad"]["gate_failures"] == ["mc 0.05 < 0.1"]


def test_explicit_reference_wins():
    summary = compare.build_summary([variant("a", "bf16", 1), variant("b", "awq-w4a16-g32-broad", 1)],
                                    [latency(1.0, None), latency(0.5, None)], [quality(1), quality(1)], QUANTIZE, "b")
    assert [r["reference"] for r in summary["variants"]] == ["b", "b"]
    assert summary["variants"][0]["mean_speedup_vs_reference"] == pytest.approx(0.5)


def test_pareto_front():
    assert compare.pareto_front({"a": (0.9, 1.0), "b": (0.8, 2.0), "c": (0.7, 1.5), "d": (None, 9.0)}) == {"a", "b"}


def test_markdown_csv_and_plots(tmp_path):
    summary = fabricated_summary()
    text = compare.markdown(summary)
    assert text.count("\n| ") == 4 and "FAIL: mc 0.05 < 0.1" in text and "mtp K=2" in text
    rows = compare.csv_rows(summary)
    assert rows[1]["short_speedup_vs_reference"] == pytest.approx(2.0) and "mc_pareto" in rows[0]
    assert set(compare.k_groups(summary)) == {"awq-w4a16-g32-broad mtp seqs8"}
    for draw, name in [(compare.plot_speedup_vs_quality, "q.png"), (compare.plot_latency_per_category, "l.png"),
                       (compare.plot_k_sweep, "k.png")]:
        draw(summary, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    no_k = dict(summary, variants=summary["variants"][:2])
    compare.plot_k_sweep(no_k, tmp_path / "none.png")  # says there is no K sweep instead of failing
    assert (tmp_path / "none.png").exists()


def test_select_picks_the_fastest_variant_that_passes():
    selection = select_variant.choose(fabricated_summary(), "mean_speedup")
    validate_json(selection, ROOT / "schemas" / "selection.schema.yaml")
    assert selection["variant"] == "awq-k2"  # awq-k2-bad is faster but failed the gate
    assert "next: awq-k1" in selection["reason"] and "failed the gate: awq-k2-bad" in selection["reason"]
    assert select_variant.choose(fabricated_summary(), "geomean_latency_ms")["variant"] == "awq-k2"


def test_select_refuses_when_nothing_passes_or_speedups_are_missing():
    summary = fabricated_summary()
    for row in summary["variants"]:
        row["gate_passed"] = False
    with pytest.raises(StageError, match="no compared variant passes the quality gate"):
        select_variant.choose(summary, "mean_speedup")
    summary = fabricated_summary()
    summary["variants"][0]["mean_speedup_vs_baseline"] = None
    with pytest.raises(StageError, match="geomean_latency_ms"):
        select_variant.choose(summary, "mean_speedup")


def test_tarball_refuses_a_variant_that_failed_the_gate(tmp_path):
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(quality(0.05)))
    with pytest.raises(StageError, match=r"failed the quality gate \(mc 0.05 < 0.1\)"):
        tarball.require_passed_gate(str(path))
    path.write_text(json.dumps(quality(0.5)))
    tarball.require_passed_gate(str(path))
