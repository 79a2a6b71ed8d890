"""Sweeps expand into named variants; compare summarises them; select ranks the candidates and checks them fastest
first, shipping the first that passes (pure parts; the walk through Snakemake's checkpoints is in test_sweep_dag)."""

import json

import pytest

import compare
import select_variant
import tarball
from conftest import ROOT
from lib.baseline import probe_baseline
from lib.dag import selection, sweeps
from lib.dag.config import contract_categories
from lib.stage import StageError, validate_json

BASE = {
    "recipe": "recipes/awq-w4a16-g32-broad.yaml",
    "serve": {"max_num_seqs": 8, "dtype": "bfloat16"},
    "speculative": {"method": "mtp", "k": 1},
}


def fill(name, point, sweep):
    """Stand-in for the schema's filling: the points here are complete already."""
    return point


def test_axes_expand_to_self_explaining_names():
    variants, members, origin = sweeps.expand(
        {"base": BASE},
        {
            "s": {
                "prefix": "tiny",
                "base": "base",
                "axes": {
                    "recipe": ["recipes/bf16.yaml", "recipes/w8a16.yaml"],
                    "speculative.k": [2, 3],
                    "serve.max_num_seqs": [1, 4],
                },
            }
        },
        fill,
    )
    assert members["s"][:3] == ["tiny-bf16-mtp2-seqs1", "tiny-bf16-mtp2-seqs4", "tiny-bf16-mtp3-seqs1"]
    assert len(members["s"]) == 8 and set(origin) == set(members["s"])
    point = variants["tiny-w8a16-mtp3-seqs4"]
    assert point["recipe"] == "recipes/w8a16.yaml" and point["speculative"] == {"method": "mtp", "k": 3}
    assert point["serve"] == {"max_num_seqs": 4, "dtype": "bfloat16"}
    assert variants["base"] == BASE  # the base is not touched


def test_mapping_labels_and_prefixes():
    _, members, _ = sweeps.expand(
        {"base": BASE},
        {
            "bits": {
                "prefix": "",
                "base": "base",
                "axes": {"recipe": {"bf16": "recipes/bf16.yaml", "int4": "recipes/x.yaml"}},
            },
            "named": {"base": "base", "axes": {"speculative.k": [2]}},
        },
        fill,
    )
    assert members == {"bits": ["bf16", "int4"], "named": ["named-mtp2"]}


def test_a_k_axis_labels_k_with_the_points_method_as_catalog_names_do():
    base = dict(BASE, speculative={"method": "ngram_gpu", "k": 4, "prompt_lookup_max": 4})
    _, members, _ = sweeps.expand(
        {"base": base},
        {"s": {"prefix": "x", "base": "base", "axes": {"speculative.k": [2, 8], "serve.max_num_seqs": [1]}}},
        fill,
    )
    assert members == {"s": ["x-ngramgpu2-seqs1", "x-ngramgpu8-seqs1"]}


def test_a_point_with_a_catalog_variants_settings_is_that_variant():
    catalog = {"tiny-awq-mtp1": BASE, "tiny-bf16-mtp1": dict(BASE, recipe="recipes/bf16.yaml")}
    variants, members, origin = sweeps.expand(
        catalog,
        {
            "tiny-bits": {
                "prefix": "tiny",
                "base": "tiny-awq-mtp1",
                "axes": {"recipe": {"bf16": "recipes/bf16.yaml", "awq": BASE["recipe"]}},
            },
            "tiny-k": {"prefix": "tiny-awq", "base": "tiny-awq-mtp1", "axes": {"speculative.k": [1, 2]}},
        },
        fill,
    )
    assert members == {"tiny-bits": ["tiny-bf16-mtp1", "tiny-awq-mtp1"], "tiny-k": ["tiny-awq-mtp1", "tiny-awq-mtp2"]}
    assert set(variants) == {"tiny-awq-mtp1", "tiny-bf16-mtp1", "tiny-awq-mtp2"}
    assert origin == {"tiny-awq-mtp2": "tiny-k"}


def test_a_point_named_like_a_catalog_variant_with_other_settings_is_an_error():
    catalog = {"base": BASE, "x-mtp2": dict(BASE, recipe="recipes/bf16.yaml")}
    with pytest.raises(sweeps.SweepError, match=r"sweeps\.s'.*generates variant 'x-mtp2' with settings other than"):
        sweeps.expand(catalog, {"s": {"prefix": "x", "base": "base", "axes": {"speculative.k": [2]}}}, fill)


def test_two_points_with_one_name_are_an_error():
    with pytest.raises(sweeps.SweepError, match="sweep 's'"):
        sweeps.expand(
            {"base": BASE}, {"s": {"base": "base", "axes": {"recipe": ["recipes/a.yaml", "other/a.yaml"]}}}, fill
        )


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"base": "nope", "axes": {"speculative.k": [1]}}, "sweeps.s.base': 'nope' is not a catalog variant"),
        ({"base": "base", "axes": {"model.name": [1]}}, "sweeps.s.axes.model.name': an axis is"),
        ({"base": "base", "axes": {"speculative.k": []}}, "non-empty list"),
        ({"base": "base", "axes": {"speculative.k": {"K 2": 2}}}, "label 'K 2' must match"),
    ],
)
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


def latency(scale: float, acceptance: float | None, fresh: float = 1.3, sets=("varied", "fresh")) -> dict:
    """A latency.json: the competition's set at `scale` of the baselines, varied text 1.2x and fresh prompts `fresh`x
    slower (acceptance 0.25 lower on fresh prompts); only the prompt sets in `sets` besides the competition's."""

    def prompt_set(factor, accept):
        categories = [
            {
                "name": name,
                "prompt_tokens": 64,
                "output_tokens_requested": 8,
                "output_tokens_mean": 8,
                "runs": 3,
                "median_ms": base * scale * factor,
                "p90_ms": base * scale * factor * 1.1,
                "p99_ms": base * scale * 1.2,
                "ttft_median_ms": 10.0,
                "itl_median_ms": 2.0,
                "baseline_ms": base,
                "speedup": 1 / (scale * factor),
                "latencies_ms": [base * scale],
                "mean_acceptance_length": accept,
                "spec_decode": {"drafts": 10, "accepted_tokens": 10 * (accept - 1) if accept else 0},
                "prefix_cache": {"queries": 0, "hits": 0, "hit_rate": None},
                "prompt_tokens_served": [64, 64, 64],
                "first_run_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            }
            for name, base in CATEGORIES
        ]
        return {
            "prompts": "made up",
            "categories": categories,
            "mean_speedup": 1 / (scale * factor),
            "mean_acceptance_length": accept,
            "prefix_cache": {"queries": 0, "hits": 0, "hit_rate": None},
        }

    fresh_acceptance = acceptance - 0.25 if acceptance else None
    return dict(
        prompt_set(1.0, acceptance),
        varied=prompt_set(1.2, acceptance) if "varied" in sets else None,
        fresh=prompt_set(fresh, fresh_acceptance) if "fresh" in sets else None,
        prompt_sets=["repeated", *sets],
        image="x",
        image_id="sha256:x",
        network="pipeline-offline",
        cold_start_s=1.0,
        warmup=1,
        ignore_eos=True,
        device_bandwidth={"device": "made up", "gbps": 150.0, "buffer_bytes": 1 << 28, "repeats": 5},
        baseline=probe_baseline(
            [{"name": name, "prompt_tokens": 64, "output_tokens": 8, "baseline_ms": base} for name, base in CATEGORIES],
            contract_categories(),
            "made up",
        ),
    )


def with_medians(record: dict, medians: dict[str, float]) -> dict:
    """`record` with its competition and fresh sets' medians per category set to `medians` (fresh 1.3x slower), each
    speedup against baseline_ms as the probe computes it."""

    def timed(prompt_set, factor):
        categories = [
            dict(c, median_ms=medians[c["name"]] * factor, speedup=c["baseline_ms"] / (medians[c["name"]] * factor))
            for c in prompt_set["categories"]
        ]
        mean = sum(c["speedup"] for c in categories) / len(categories)
        return dict(prompt_set, categories=categories, mean_speedup=mean)

    return dict(timed(record, 1.0), fresh=timed(record["fresh"], 1.3))


def quality(score: float, threshold: float = 0.1) -> dict:
    return {
        "passed": score >= threshold,
        "image": "x",
        "tasks": [
            {"name": "mc", "score": score, "threshold": threshold, "passed": score >= threshold},
            {"name": "ifeval", "score": 0.5, "threshold": 0.0, "passed": True},
        ],
    }


QUANTIZE = {
    "bf16": {"quantized": False, "output_bytes": 800, "recipe": {"groups": []}},
    "awq-w4a16-g32-broad": {
        "quantized": True,
        "output_bytes": 300,
        "recipe": {"groups": [{"weights": {"num_bits": 4}}]},
        # 2.0 GB decoder + a tied bf16 head of 1.2 GB, MTP layer 0.1 GB (scripts/lib/decode_bytes.py)
        "decode_step": {"decoder": 2_000_000_000, "lm_head": 1_200_000_000, "mtp_per_draft": 1_300_000_000},
    },
}


def variant(name, key, k, seqs=8):
    return {
        "name": name,
        "recipe": f"recipes/{key}.yaml",
        "recipe_key": key,
        "serve": {"max_num_seqs": seqs},
        "speculative": {"method": "mtp", "k": k},
    }


def fabricated_summary():
    variants = [
        variant("bf16-k1", "bf16", 1),
        variant("awq-k1", "awq-w4a16-g32-broad", 1),
        variant("awq-k2", "awq-w4a16-g32-broad", 2),
        variant("awq-k2-bad", "awq-w4a16-g32-broad", 2, seqs=4),
    ]
    # awq-k2 is the fastest passing variant on the competition's prompts, awq-k1 on fresh ones
    latencies = [latency(1.0, 1.5), latency(0.5, 1.5, fresh=1.1), latency(0.4, 2.0, fresh=1.5), latency(0.1, 2.0)]
    qualities = [quality(0.9), quality(0.7), quality(0.6), quality(0.05)]
    return compare.build_summary(variants, latencies, qualities, QUANTIZE, None)


def test_bytes_per_step_count_the_mtp_passes_and_give_the_a10g_and_probe_floors():
    rows = {r["variant"]: r for r in fabricated_summary()["variants"]}
    assert rows["bf16-k1"]["decode_step"] is None  # a report from before decode_step: nothing made up
    k1, k2 = rows["awq-k1"]["decode_step"], rows["awq-k2"]["decode_step"]
    assert (k1["bytes"], k2["bytes"]) == (4_500_000_000, 5_800_000_000) and k2["draft_passes"] == 2
    assert k1["a10g_bound_ms"] == pytest.approx(4.5e9 / 600e9 * 1e3)  # 7.5 ms a step at 600 GB/s
    accepted = rows["awq-k1"]["latency"]["short"]["mean_acceptance_length"]
    assert k1["a10g_bound_ms_per_token"]["short"] == pytest.approx(7.5 / accepted, abs=1e-4)
    assert k1["itl_median_ms"]["short"] == rows["awq-k1"]["latency"]["short"]["itl_median_ms"]
    # and at the bandwidth measured where the probe ran: 4.5 GB at 150 GB/s is 30 ms a step
    assert (k1["probe_device"], k1["probe_gbps"]) == ("made up", 150.0) and k1["probe_bound_ms"] == pytest.approx(30)
    assert k1["probe_bound_ms_per_token"]["short"] == pytest.approx(30 / accepted, abs=1e-4)
    assert "| 4.5 (7.5, 30) |" in compare.markdown(fabricated_summary())


def test_decode_step_bytes_of_a_checkpoint_count_a_tied_head_once(tmp_path):
    from lib.decode_bytes import part_bytes, step_bytes
    from unit.test_quantize import write_safetensors

    untied = {
        "model.language_model.layers.0.mlp.up_proj.weight": ("BF16", [64, 32]),
        "model.language_model.embed_tokens.weight": ("BF16", [100, 32]),
        "lm_head.weight": ("BF16", [100, 32]),
        "mtp.fc.weight": ("BF16", [32, 64]),
    }
    write_safetensors(tmp_path / "model.safetensors", untied)
    step = step_bytes(part_bytes(tmp_path), draft_passes=2)
    assert step["tied_head"] is False and step["lm_head"] == 6400
    assert step["total"] == 4096 + 6400 + 2 * (4096 + 6400)
    del untied["lm_head.weight"]
    write_safetensors(tmp_path / "model.safetensors", untied)
    tied = step_bytes(part_bytes(tmp_path))
    assert tied["tied_head"] is True and tied["lm_head"] == 6400 and tied["total"] == 4096 + 6400


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


def test_the_latency_records_made_up_here_are_what_the_probe_writes():
    validate_json(latency(0.5, 1.5), ROOT / "schemas" / "latency.schema.yaml")
    validate_json(latency(0.5, None, sets=()), ROOT / "schemas" / "latency.schema.yaml")


def test_summary_puts_every_prompt_sets_speedups_side_by_side():
    summary = fabricated_summary()
    assert summary["prompt_sets"] == ["repeated", "varied", "fresh"] and summary["competition_set"] == "repeated"
    rows = {r["variant"]: r for r in summary["variants"]}
    awq = rows["awq-k2"]
    # the competition's set is the unprefixed one select ranks by
    competition = awq["prompt_sets"]["repeated"]["mean_speedup_vs_baseline"]
    assert competition == awq["mean_speedup_vs_baseline"] == pytest.approx(2.5)
    assert awq["prompt_sets"]["varied"]["mean_speedup_vs_baseline"] == pytest.approx(2.5 / 1.2)
    assert awq["prompt_sets"]["fresh"]["mean_speedup_vs_baseline"] == pytest.approx(2.5 / 1.5)
    # vs BF16 on the same prompt set: bf16 is 1.3x slower on fresh prompts, awq-k2 1.5x
    assert awq["prompt_sets"]["fresh"]["mean_speedup_vs_reference"] == pytest.approx(1.3 / (0.4 * 1.5))
    assert awq["fresh_latency"]["short"]["speedup_vs_reference"] == pytest.approx(1.3 / 0.6)
    assert awq["prompt_sets"]["fresh"]["mean_acceptance_length"] == pytest.approx(1.75)
    assert awq["fresh_vs_competition"] == pytest.approx(1 / 1.5)
    assert awq["prompt_sets"]["fresh"]["prefix_cache_hit_rate"] is None  # prefix caching off
    text = compare.markdown(summary)
    assert "speedup × the contract's A10G baseline (meaningful on an A10G only) (repeated / varied / fresh)" in text
    assert (
        "| awq-k2 | awq-w4a16-g32-broad | 4 | 0.0 | 5.8 (9.67, 38.7) | mtp K=2 | 8 "
        "| 2.50 / 2.08 / 1.67 | 2.50 / 2.50 / 2.17 |" in text
    )
    assert "| awq-k2 | fresh | 1549 | 3265 | 3946 | 1.67 |" in text  # the per-set table
    csv_row = compare.csv_rows(summary)[2]
    assert csv_row["fresh_mean_speedup_vs_baseline"] == pytest.approx(2.5 / 1.5)
    assert csv_row["fresh_short_median_ms"] == pytest.approx(2582 * 0.6)
    assert "varied_long_mean_acceptance_length" in csv_row


def test_summary_without_the_other_prompt_sets():
    summary = compare.build_summary(
        [variant("a", "bf16", 1), variant("b", "awq-w4a16-g32-broad", 1)],
        [latency(1.0, None, sets=()), latency(0.5, None, sets=("fresh",))],
        [quality(1), quality(1)],
        QUANTIZE,
        None,
    )
    validate_json(summary, ROOT / "schemas" / "summary.schema.yaml")
    assert summary["prompt_sets"] == ["repeated", "fresh"]
    a, b = summary["variants"]
    assert a["prompt_sets"]["fresh"] is None and a["fresh_latency"] is None and a["fresh_vs_competition"] is None
    assert b["prompt_sets"]["fresh"]["mean_speedup_vs_reference"] is None  # the reference has no fresh set
    rows = compare.csv_rows(summary)
    assert list(rows[0]) == list(rows[1]) and rows[0]["fresh_short_median_ms"] is None
    assert "| a | bf16 | 16 | 0.0 | - | mtp K=1 | 8 | 1.00 / - | 1.00 / - |" in compare.markdown(summary)


def test_explicit_reference_wins():
    summary = compare.build_summary(
        [variant("a", "bf16", 1), variant("b", "awq-w4a16-g32-broad", 1)],
        [latency(1.0, None), latency(0.5, None)],
        [quality(1), quality(1)],
        QUANTIZE,
        "b",
    )
    assert [r["reference"] for r in summary["variants"]] == ["b", "b"]
    assert summary["variants"][0]["mean_speedup_vs_reference"] == pytest.approx(0.5)


def test_summary_says_what_its_ratios_are_against():
    """The probes' baseline_ms are the contract's A10G numbers: the summary, its table and its plots' titles say so
    (and where the probes ran, and the sizes unlike the contract's) wherever they show a ratio against them."""
    summary = fabricated_summary()
    baseline = summary["baseline"]
    assert baseline["kind"] == "contract_a10g" and "probed on made up" in baseline["text"]
    assert "the long category sends 64 prompt tokens, not the contract's 8,192" in baseline["text"]
    # no compared bf16 variant without speculation (bf16-k1 speculates): the speed axis is the contract's baseline
    assert summary["speed_baseline"] == baseline
    assert summary["speed_axis"] == "mean speedup × the contract's A10G baseline (meaningful on an A10G only)"
    text = compare.markdown(summary)
    assert text.startswith(f"Speedup vs baseline: {baseline['text']}.")
    assert f"Speed (plots, Pareto fronts): {baseline['text']}." in text
    title = " ".join(compare.plot_title("Speed vs quality", summary).split())
    assert title.startswith("Speed vs quality speed: × the contract's A10G baseline (meaningful on an A10G only)")


# bf16 on this host is slow on long prompts: against it, y is the faster; against the contract's A10G numbers, x is
BF16_MEDIANS = {"short": 1000.0, "medium": 20000.0, "long": 40000.0}
X_MEDIANS = {"short": 500.0, "medium": 10000.0, "long": 20000.0}  # 2.0x bf16 here; 2.01x the A10G baselines
Y_MEDIANS = {"short": 1000.0, "medium": 5000.0, "long": 10000.0}  # 3.0x bf16 here; 1.44x the A10G baselines


def test_summary_speed_is_against_a_compared_same_host_bf16_variant():
    bf16 = dict(variant("bf16-none", "bf16", 0), speculative={"method": "none", "k": 0})
    x = dict(variant("x", "awq-w4a16-g32-broad", 0), speculative={"method": "none", "k": 0})
    summary = compare.build_summary(
        [bf16, x, variant("y", "awq-w4a16-g32-broad", 1)],
        [with_medians(latency(1.0, None), m) for m in (BF16_MEDIANS, X_MEDIANS, Y_MEDIANS)],
        [quality(0.9), quality(0.5), quality(0.5)],
        QUANTIZE,
        None,
    )
    validate_json(summary, ROOT / "schemas" / "summary.schema.yaml")
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["x"]["mean_speedup_vs_baseline"] > rows["y"]["mean_speedup_vs_baseline"]  # the A10G order
    assert summary["speed_baseline"]["kind"] == "same_host_bf16" and summary["speed_baseline"]["variant"] == "bf16-none"
    assert summary["speed_axis"] == "mean speedup × same-host bf16 (bf16-none)"
    speeds = {name: compare.set_speed(summary, row, "repeated") for name, row in rows.items()}
    assert speeds == {"bf16-none": pytest.approx(1.0), "x": pytest.approx(2.0), "y": pytest.approx(3.0)}
    assert compare.set_speed(summary, rows["y"], "fresh") == pytest.approx(3.0)  # against bf16's own fresh medians
    # the Pareto fronts are on this speed: y (faster here, same score) leaves x off
    assert [name for name, row in rows.items() if row["pareto"]["mc"]] == ["bf16-none", "y"]
    assert "Speed (plots, Pareto fronts): × same-host bf16 (bf16-none): " in compare.markdown(summary)
    assert "speed: × same-host bf16 (bf16-none)" in " ".join(compare.plot_title("t", summary).split())


def test_pareto_front():
    assert compare.pareto_front({"a": (0.9, 1.0), "b": (0.8, 2.0), "c": (0.7, 1.5), "d": (None, 9.0)}) == {"a", "b"}


def test_markdown_csv_and_plots(tmp_path):
    summary = fabricated_summary()
    text = compare.markdown(summary)
    # the main table: header and a row per variant; the per-set table: header, variants x sets
    assert text.count("\n| ") == 1 + 4 + 1 + 4 * 3
    assert "FAIL: mc 0.05 < 0.1" in text and "mtp K=2" in text
    rows = compare.csv_rows(summary)
    assert rows[1]["short_speedup_vs_reference"] == pytest.approx(2.0) and "mc_pareto" in rows[0]
    assert set(compare.k_groups(summary)) == {"awq-w4a16-g32-broad mtp seqs8"}
    for draw, name in [
        (compare.plot_speedup_vs_quality, "q.png"),
        (compare.plot_latency_per_category, "l.png"),
        (compare.plot_k_sweep, "k.png"),
    ]:
        draw(summary, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    no_k = dict(summary, variants=summary["variants"][:2])
    compare.plot_k_sweep(no_k, tmp_path / "none.png")  # says there is no K sweep instead of failing
    assert (tmp_path / "none.png").exists()


# ---- select: the ranking and the walk, on fabricated records ----

# Four candidates, fastest first on the competition's prompts: a, b, c, d (d the fastest on fresh prompts).
LATENCIES = {
    "c": latency(0.5, 2.0, fresh=1.4),
    "a": latency(0.2, 2.0, fresh=2.0),
    "d": latency(0.8, 1.5, fresh=0.4),
    "b": latency(0.3, 2.0, fresh=1.6),
}
FIRST_DIFFERENCE = (
    "repeated prompts, category short: greedy output differs first at output token 3 (speculative 9, without "
    "speculation 8)"
)


def lossless_record(variant: str, passed: bool) -> dict:
    return {
        "variant": variant,
        "passed": passed,
        "method": "mtp",
        "k": 2,
        "reference": "own image, speculation off",
        "reason": "x",
        "rows": [],
        "failures": [] if passed else [FIRST_DIFFERENCE],
    }


def ranked() -> dict:
    return selection.rank(LATENCIES, "mean_speedup")


def test_rank_orders_every_candidate_by_the_competition_set_with_fresh_prompts_beside():
    ranking = ranked()
    validate_json(ranking, ROOT / "schemas" / "ranking.schema.yaml")
    rows = {row["variant"]: row for row in ranking["candidates"]}
    assert [row["variant"] for row in ranking["candidates"]] == ["a", "b", "c", "d"] == selection.order(ranking)
    assert [rows[name]["rank"] for name in "abcd"] == [1, 2, 3, 4]
    assert rows["a"]["mean_speedup_vs_baseline"] == pytest.approx(5.0)
    assert rows["a"]["fresh_mean_speedup_vs_baseline"] == pytest.approx(2.5)
    assert rows["d"]["fresh_mean_speedup_vs_baseline"] == pytest.approx(3.125)
    assert [rows[name]["fresh_rank"] for name in "abcd"] == [2, 3, 4, 1]
    by_latency = selection.rank(LATENCIES, "geomean_latency_ms")
    assert selection.order(by_latency) == ["a", "b", "c", "d"] and by_latency["by"] == "geomean_latency_ms"
    assert by_latency["candidates"][0]["geomean_latency_ms"] < by_latency["candidates"][1]["geomean_latency_ms"]
    # a tie on the competition's set keeps the candidates' order
    assert selection.order(selection.rank({"y": latency(0.5, 2.0), "x": latency(0.5, 2.0)}, "mean_speedup")) == [
        "y",
        "x",
    ]


def test_rank_refuses_mean_speedup_without_baselines_and_says_what_to_set():
    no_baseline = dict(latency(0.5, 2.0), mean_speedup=None)
    with pytest.raises(StageError, match="c's probe has none. Set select.by: geomean_latency_ms"):
        selection.rank({"a": latency(0.2, 2.0), "c": no_baseline}, "mean_speedup")
    assert selection.order(selection.rank({"a": latency(0.2, 2.0), "c": no_baseline}, "geomean_latency_ms")) == [
        "a",
        "c",
    ]


def test_rank_divides_by_the_same_host_bf16_variant_when_the_run_has_one():
    """Against the contract's A10G baseline_ms x is the faster; against bf16 measured on this host, y: with the bf16
    variant's record the ranking (and so the order select checks in) is this host's, and says so."""
    candidates = {"x": with_medians(latency(1.0, None), X_MEDIANS), "y": with_medians(latency(1.0, None), Y_MEDIANS)}
    contract = selection.rank(candidates, "mean_speedup")
    assert selection.order(contract) == ["x", "y"] and contract["baseline"]["kind"] == "contract_a10g"
    bf16 = ("bf16-none", with_medians(latency(1.0, None), BF16_MEDIANS))
    ranking = selection.rank(candidates, "mean_speedup", bf16)
    validate_json(ranking, ROOT / "schemas" / "ranking.schema.yaml")
    assert selection.order(ranking) == ["y", "x"]
    assert ranking["baseline"] == {
        "kind": "same_host_bf16",
        "variant": "bf16-none",
        "label": "× same-host bf16 (bf16-none)",
        "text": ranking["baseline"]["text"],
    }
    rows = {row["variant"]: row for row in ranking["candidates"]}
    assert rows["y"]["mean_speedup_vs_baseline"] == pytest.approx(3.0)
    assert rows["x"]["fresh_mean_speedup_vs_baseline"] == pytest.approx(2.0)  # bf16's fresh medians, 1.3x too
    chosen = selection.choose(ranking, {"y": lossless_record("y", True)}, {"y": quality(0.9)})
    validate_json(chosen, ROOT / "schemas" / "selection.schema.yaml")
    assert chosen["baseline"] == ranking["baseline"]
    assert "(mean speedup 3.000 × same-host bf16 (bf16-none) on the competition's repeated prompts" in chosen["reason"]
    # a bf16 probe without one of a candidate's categories gives no ratio: the ranking says so
    short_only = dict(bf16[1], categories=bf16[1]["categories"][:1])
    with pytest.raises(StageError, match="bf16-none: its probe lacks a category x's has"):
        selection.rank(candidates, "mean_speedup", ("bf16-none", short_only))


def test_a_candidate_without_fresh_prompts_has_no_fresh_rank():
    ranking = selection.rank({"a": latency(0.2, 2.0, sets=()), "b": latency(0.3, 2.0)}, "mean_speedup")
    validate_json(ranking, ROOT / "schemas" / "ranking.schema.yaml")
    assert [(row["variant"], row["fresh_rank"]) for row in ranking["candidates"]] == [("a", None), ("b", 1)]


def walked(outcomes: dict[str, tuple[bool, bool]]) -> tuple[list[tuple[str, str]], list]:
    """The walk over ranked() with each candidate's (lossless passed, gate passed): the checks it asked for, in
    order, and what it returned."""
    asked = []

    def lossless_of(variant):
        asked.append(("lossless", variant))
        return lossless_record(variant, outcomes[variant][0])

    def gate_of(variant):
        asked.append(("quality_gate", variant))
        return quality(0.9 if outcomes[variant][1] else 0.05)

    return asked, selection.walk(selection.order(ranked()), lossless_of, gate_of)


def test_the_walk_checks_fastest_first_gates_only_after_the_lossless_check_and_stops_at_the_first_pass():
    asked, visited = walked({"a": (False, True), "b": (True, False), "c": (True, True), "d": (True, True)})
    # a: lossy, so never gated; b: lossless but fails the gate; c passes both; d (slower) is never checked
    assert asked == [
        ("lossless", "a"),
        ("lossless", "b"),
        ("quality_gate", "b"),
        ("lossless", "c"),
        ("quality_gate", "c"),
    ]
    assert [(variant, quality is not None) for variant, _, quality in visited] == [
        ("a", False),
        ("b", True),
        ("c", True),
    ]
    asked, _ = walked(dict.fromkeys("abcd", (True, True)))
    assert asked == [("lossless", "a"), ("quality_gate", "a")]  # the fastest passes: nothing else is checked
    asked, _ = walked(dict.fromkeys("abcd", (False, True)))
    assert asked == [("lossless", name) for name in "abcd"]  # all lossy: no gate at all


def choose(outcomes: dict[str, tuple[bool, bool]]) -> dict:
    """select's record from the records the walk visited (exactly those: choose refuses to guess a missing one)."""
    _, visited = walked(outcomes)
    return selection.choose(
        ranked(),
        {variant: lossless for variant, lossless, _ in visited},
        {variant: quality for variant, _, quality in visited if quality is not None},
    )


def test_selection_gives_every_candidates_rank_speeds_and_outcome():
    chosen = choose({"a": (False, True), "b": (True, False), "c": (True, True), "d": (True, True)})
    validate_json(chosen, ROOT / "schemas" / "selection.schema.yaml")
    assert chosen["variant"] == "c" and chosen["mode"] == "fastest" and chosen["by"] == "mean_speedup"
    rows = {row["variant"]: row for row in chosen["candidates"]}
    assert [row["variant"] for row in chosen["candidates"]] == ["a", "b", "c", "d"]
    assert [rows[name]["outcome"] for name in "abcd"] == ["failed", "failed", "won", "not_gated"]
    assert rows["a"]["failed_check"] == "lossless"
    assert rows["a"]["failures"] == [f"not lossless against own image, speculation off: {FIRST_DIFFERENCE}"]
    assert rows["b"]["failed_check"] == "quality_gate" and rows["b"]["failures"] == ["mc 0.05 < 0.1"]
    assert rows["c"]["failed_check"] is None and rows["d"]["failures"] == []
    assert (rows["c"]["rank"], rows["c"]["fresh_rank"]) == (3, 4)
    assert rows["c"]["mean_speedup_vs_baseline"] == pytest.approx(2.0)
    assert rows["c"]["fresh_mean_speedup_vs_baseline"] == pytest.approx(2.0 / 1.4)
    reason = chosen["reason"]
    assert reason.startswith(
        "fastest by mean_speedup of the 4 candidates to pass the lossless check and the quality gate (mean speedup "
        "2.000 × the contract's A10G baseline (meaningful on an A10G only) on the competition's repeated prompts, "
        "1.429 on fresh prompts; rank 3)"
    ), reason
    assert (
        f"faster but failed: a (failed the lossless check: not lossless against own image, speculation off: "
        f"{FIRST_DIFFERENCE}); b (failed the quality gate: mc 0.05 < 0.1)"
    ) in reason
    assert "slower, never gated: d (mean speedup 1.250 × the contract's A10G baseline" in reason
    # honest: the ranking is the competition's, and on fresh prompts another candidate is the fastest
    assert reason.endswith("on fresh prompts d would be the fastest (not gated)"), reason


def test_the_fastest_candidate_passing_ships_and_the_others_stay_unchecked():
    chosen = choose(dict.fromkeys("abcd", (True, True)))
    assert chosen["variant"] == "a"
    assert [row["outcome"] for row in chosen["candidates"]] == ["won", "not_gated", "not_gated", "not_gated"]
    assert "faster but failed" not in chosen["reason"] and "slower, never gated: b (" in chosen["reason"]
    by_latency = selection.choose(
        selection.rank(LATENCIES, "geomean_latency_ms"), {"a": lossless_record("a", True)}, {"a": quality(0.9)}
    )
    assert by_latency["variant"] == "a" and "ms on fresh prompts" in by_latency["reason"]


def test_select_needs_every_record_the_walk_visits():
    with pytest.raises(StageError, match="select needs b's lossless record"):
        selection.choose(ranked(), {"a": lossless_record("a", False)}, {})
    with pytest.raises(StageError, match="select needs a's quality gate record"):
        selection.choose(ranked(), {"a": lossless_record("a", True)}, {})


def test_every_candidate_failing_fails_select_naming_each_one_and_why():
    with pytest.raises(StageError) as caught:
        choose({"a": (False, True), "b": (True, False), "c": (False, True), "d": (True, False)})
    message = str(caught.value)
    assert message.startswith("no candidate passes the lossless check and the quality gate; nothing to ship")
    assert "a (rank 1): failed the lossless check: not lossless against own image, speculation off: " in message
    assert "b (rank 2): failed the quality gate: mc 0.05 < 0.1" in message
    assert "c (rank 3): failed the lossless check" in message and "d (rank 4): failed the quality gate" in message


def test_the_select_stage_reads_the_visited_records_by_the_walks_order(tmp_path):
    """scripts/select_variant.py as Snakemake calls it: the inputs in the walk's order, `visited` saying whose."""
    from types import SimpleNamespace

    _, visited = walked({"a": (False, True), "b": (True, True), "c": (True, True), "d": (True, True)})
    paths = {}
    for variant, lossless, quality_record in visited:
        for kind, record in (("lossless", lossless), ("quality", quality_record)):
            if record is not None:
                paths.setdefault(kind, []).append(str(tmp_path / f"{variant}.{kind}.json"))
                (tmp_path / f"{variant}.{kind}.json").write_text(json.dumps(record))
    (tmp_path / "ranking.json").write_text(json.dumps(ranked()))
    job = SimpleNamespace(
        input=SimpleNamespace(
            ranking=str(tmp_path / "ranking.json"),
            schema=str(ROOT / "schemas" / "selection.schema.yaml"),
            **paths,
        ),
        output=SimpleNamespace(selection=str(tmp_path / "selection.json")),
        params=SimpleNamespace(visited=[["a", False], ["b", True]]),
    )
    select_variant.main(job)
    chosen = json.loads((tmp_path / "selection.json").read_text())
    assert chosen["variant"] == "b" and [c["outcome"] for c in chosen["candidates"]][:2] == ["failed", "won"]
    job.params.visited = [["b", False], ["a", True]]  # records handed over under the wrong names
    with pytest.raises(StageError, match="given a's lossless record for b"):
        select_variant.main(job)


def test_tarball_refuses_a_variant_that_failed_the_gate(tmp_path):
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(quality(0.05)))
    with pytest.raises(StageError, match=r"failed the quality gate \(mc 0.05 < 0.1\)"):
        tarball.require_passed_gate(str(path))
    path.write_text(json.dumps(quality(0.5)))
    tarball.require_passed_gate(str(path))
