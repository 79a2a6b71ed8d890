"""docs/results.md and the README's results table are what tools/render_results.py makes of the records."""

import json
import shutil
import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import render_results  # noqa: E402


def test_the_committed_docs_are_what_the_records_give(capsys):
    assert render_results.main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def project_copy(tmp_path, monkeypatch):
    """The records, docs/results.md and README.md in a scratch tree the renderer is pointed at."""
    shutil.copytree(ROOT / "records" / "gpu-proof", tmp_path / "records")
    (tmp_path / "docs").mkdir()
    for name in ("docs/results.md", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(render_results, "ROOT", tmp_path)
    monkeypatch.setattr(render_results, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(render_results, "RESULTS_MD", tmp_path / "docs" / "results.md")
    monkeypatch.setattr(render_results, "README", tmp_path / "README.md")
    return tmp_path


def test_a_hand_edit_or_a_changed_record_fails_the_check_naming_the_file_and_the_command(project_copy, capsys):
    assert render_results.main(["--check"]) == 0
    readme = project_copy / "README.md"
    readme.write_text(readme.read_text().replace("| H", "| h", 1))  # a table cell edited by hand
    assert render_results.main(["--check"]) == 1
    assert "README.md is not what the records give: run `python3 tools/render_results.py`" in capsys.readouterr().err
    record_path = next((project_copy / "records").glob("*/*-bf16.json"))
    record = json.loads(record_path.read_text())
    record["sets"]["repeated"]["categories"][0]["median_ms"] *= 2
    record_path.write_text(json.dumps(record))
    assert render_results.main([]) == 0  # regenerates both
    assert render_results.main(["--check"]) == 0


def variant(host: str, name: str, medians: dict[str, list[float]], options: dict | None = None) -> dict:
    sets = {
        set_name: {
            "categories": [
                {"name": c, "median_ms": m} for c, m in zip(("short", "medium", "long"), values, strict=True)
            ]
        }
        for set_name, values in medians.items()
    }
    return {"kind": "variant", "host": host, "variant": name, "options": options or {}, "sets": sets}


def test_speedups_are_over_bf16_of_the_same_host_only():
    records = [
        variant("a", "bf16", {"repeated": [400, 800, 1200]}),
        variant("a", "fast", {"repeated": [100, 400, 1200]}),
        variant("b", "fast", {"repeated": [100, 100, 100]}),
        variant(
            "b",
            "bf16",
            {"repeated": [100, 100, 100]},
            options={"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 8},
        ),
        variant(
            "b",
            "shared",
            {"repeated": [50, 50, 50]},
            options={"gpu_memory_utilization": 0.4, "kv_cache_memory_bytes": 8, "drafter": "x"},
        ),
    ]
    fast_a, fast_b, shared_b = records[1], records[2], records[4]
    assert render_results.speedup(fast_a, render_results.reference_of(records, fast_a), "repeated") == pytest.approx(
        (4 + 2 + 1) / 3
    )
    # host b's bf16 shared the GPU with a fixed KV cache: the reference of a variant that did too, whatever share of the
    # start-up check each had, not of one that had the GPU alone (and never a ratio across hosts)
    assert render_results.reference_of(records, fast_b) is None
    assert render_results.reference_of(records, shared_b) is records[3]
    assert render_results.speedup(fast_b, None, "repeated") is None
    assert render_results.speedup(fast_a, records[0], "fresh") is None  # a set bf16 did not run


def test_cost_and_correctness_are_separate_tables_and_random_weights_decide_no_lossless_verdict():
    """Random-weight lossless checks are not evidence (their flat logits part at near ties), so only the trained
    checkpoint's checks are tabled; trained variants go to the acceptance table, not the cost one, and a speedup is
    over bf16 of the same host and engine."""
    base = {"gpu": "NVIDIA H200", "date": "2026-11-29", "cold_start": {"cache": "empty", "seconds": 1.0}}

    def row(name, engine, weights, medians, acceptance=None):
        record = variant("h", name, {s: medians for s in ("repeated", "varied", "fresh")}) | base
        for probed in record["sets"].values():
            for category in probed["categories"]:
                category.update(itl_median_ms=1.5, ttft_median_ms=9.0, mean_acceptance_length=acceptance)
        return record | {"engine": engine, "weights": weights, "bytes_per_step": None}

    def check(name, weights, passed):
        rows = [{"passed": passed, "near_tie_nats": None, "first_difference": None if passed else 7}]
        checks = [{"variant": name, "reference_variant": "plain", "passed": passed, "rows": rows}]
        return {"kind": "lossless", "host": "h", "engine": "0.32.0", "weights": weights, "checks": checks} | base

    records = [
        row("bf16", "0.26.0", "random", [400, 800, 1200]),
        row("bf16", "0.32.0", "random", [200, 400, 600]),
        row("awq", "0.32.0", "random", [100, 200, 300]),
        row("tiny-awq-mtp2", "0.32.0", "trained", [50, 60, 70], acceptance=2.9),
        check("random-suffix", "random", False),
        check("tiny-awq-mtp2", "trained", True),
        check("tiny-awq-ngram4", "trained", False),
        check("tiny-canary", "trained", False),
        {"kind": "environment", "host": "h", "cpu": None, "vllm": "0.32.0", "copy_gbps": None} | base,
    ]
    records[-2]["checks"][0]["canary"] = "checked against another variant's reference: it must fail"
    records[2]["warm_start"] = {"cache": "the first start's", "seconds": 21.4, "compile_log": []}
    records[2]["cold_start"] = {"cache": "empty", "seconds": 95.0}
    text = render_results.results_md(records)
    cost = text[text.index("Cost (") : text.index("Acceptance and step cost")]
    acceptance = text[text.index("Acceptance and step cost") : text.index("Lossless check")]
    lossless = text[text.index("Lossless check") :]
    assert "`awq` | 0.32.0 | h, 2026-11-29 | 2.00 / 2.00 / 2.00 |" in cost  # over 0.32's bf16, not 0.26's (4x)
    assert (
        "tiny-awq-mtp2" not in cost
        and "| `tiny-awq-mtp2` | 0.32.0 | h, 2026-11-29 | 2.90 / 2.90 / 2.90 |" in acceptance
    )
    assert "random-suffix" not in text
    assert "| `tiny-awq-mtp2` | `plain` | 0.32.0 | h, 2026-11-29 | passed | 1 of 1 |" in lossless
    assert "| `tiny-awq-ngram4` | `plain` | 0.32.0 | h, 2026-11-29 | FAILED | 0 of 1 | 0 | 7 |" in lossless
    assert "| `tiny-canary` | `plain` | 0.32.0 | h, 2026-11-29 | FAILED, as a canary must | 0 of 1 |" in lossless
    assert "| 95 (empty), then 21 (its own cache) |" in cost  # a restart on the bake's cache beside the first start
    readme = render_results.readme_table(records, "0.32.0")
    assert "| H200 | `awq` | 2.00× |" in readme and "tiny" not in readme


def test_the_readme_takes_a_quiet_hosts_run_over_a_later_one_probed_while_servers_started():
    base = {"gpu": "NVIDIA H200", "date": "2026-11-29", "engine": "0.32.0", "weights": "random", "bytes_per_step": None}
    quiet = [variant("q", name, {"repeated": [m] * 3}) | base for name, m in (("bf16", 400), ("awq", 200))]
    later = base | {"date": "2099-01-01", "host_busy": True}
    busy = [variant("z", name, {"repeated": [m] * 3}) | later for name, m in (("bf16", 400), ("awq", 400))]
    assert "| `awq` | 2.00× |" in render_results.readme_table(quiet + busy, "0.32.0")
    assert "| `awq` | 1.00× |" in render_results.readme_table(busy, "0.32.0")  # a busy host's run where no quiet one


def test_the_readme_shows_only_the_engine_the_release_config_ships():
    """Older engines' runs stay in docs/results.md; the README's table is the release profile's engine.vllm only,
    each speedup over that engine's bf16."""
    base = {"gpu": "NVIDIA H200", "date": "2026-11-29", "weights": "random", "bytes_per_step": None}
    runs = (("0.26.0", "bf16", 400), ("0.26.0", "old-only", 100), ("0.26.0", "both", 100))
    runs += (("0.32.0", "bf16", 400), ("0.32.0", "both", 200))
    records = [variant("h", name, {"repeated": [m] * 3}) | base | {"engine": engine} for engine, name, m in runs]
    table = render_results.readme_table(records, "0.32.0")
    assert "| H200 | `both` | 2.00× |" in table and "old-only" not in table and "4.00×" not in table
    assert "vLLM 0.32.0" in table
    assert "No GPU record" in render_results.readme_table(records, "0.99.0")
    # the committed records: the other engines' records change nothing in the README's table
    committed, shipped = render_results.load(), render_results.shipped_engine()
    assert {r.get("engine") for r in committed} - {shipped}, "the records hold no older engine: nothing is shown"
    mine = [r for r in committed if r.get("engine", shipped) == shipped]
    assert render_results.readme_table(committed, shipped) == render_results.readme_table(mine, shipped)


def test_the_shipped_engine_is_the_release_configs_engine_vllm_else_the_schemas_default(tmp_path):
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    default = schema["properties"]["engine"]["properties"]["vllm"]["default"]
    config = tmp_path / "config.yaml"
    config.write_text("engine: {vllm: 0.99.0}\n")
    assert render_results.shipped_engine(config) == "0.99.0"
    config.write_text("model: {name: x}\n")
    assert render_results.shipped_engine(config) == default


def test_each_probe_says_how_many_other_servers_were_resident_and_an_older_record_says_unknown():
    base = {"gpu": "NVIDIA H200", "date": "2026-11-29", "engine": "0.32.0", "weights": "random", "bytes_per_step": None}
    base["cold_start"] = {"cache": "empty", "seconds": 1.0}
    records = [variant("h", name, {"repeated": [m] * 3}) | base for name, m in (("bf16", 400), ("awq", 200))]
    for category in [c for record in records for c in record["sets"]["repeated"]["categories"]]:
        category.update(itl_median_ms=1.5, ttft_median_ms=9.0, mean_acceptance_length=None)
    records[0]["resident_servers"] = 3
    rows = {line.split(" | ")[0]: line for line in render_results.variant_rows(records, "NVIDIA H200")}
    assert rows["| `bf16`"].endswith("| 1 (empty) | 3 |") and rows["| `awq`"].endswith("| 1 (empty) | unknown |")


def test_an_ab_floor_shows_each_lengths_prefill_both_ways_and_a_verdict_only_on_trained_weights():
    base = {"kind": "floor", "host": "h", "gpu": "NVIDIA H200", "date": "2026-12-01", "engine": "0.32.0"}
    base |= {"config": "config.yaml", "step_median_ms": 3.5, "tokens": 128, "runs": 5, "ab": "gdn_prefill_graphs"}
    timed = {"prefill_ms": {"off": {"64": 69.0, "8192": 190.0}, "on": {"64": 20.0, "8192": 180.0}}}
    trained = base | timed | {"variant": "tiny-awq-mtp2", "weights": "trained", "same": {"64": True, "8192": False}}
    random = base | timed | {"variant": "bf16", "weights": "random", "same": {"64": True, "8192": True}}
    random["profile"] = {
        label: {"gdn_calls": 24, "gdn_host_ms_per_call": ms, "gpu_busy_ms": 5.0}
        for label, ms in (("off", 3.38), ("on", 0.37))
    }
    drafted = random | {"variant": "bf16-suffix", "ab": "suffix_tree_overlap"}
    drafted["profile"] = {
        label: {"gdn_calls": 0, "gdn_host_ms_per_call": None, "gpu_busy_ms": 200.0, "runner_scopes_ms": {"draft": ms}}
        for label, ms in (("off", 28.08), ("on", 0.52))
    }
    floors = [trained, random, drafted]
    rows = {line.split(" | ")[0]: line for line in render_results.prefill_rows(floors, "NVIDIA H200")}
    assert "| 64: 69 → 20; 8192: 190 → 180 | 8192 differ | — |" in rows["| `tiny-awq-mtp2`"]
    assert "| all (random weights: no verdict) | GDN op a call 3.38 → 0.37 |" in rows["| `bf16`"]
    assert rows["| `bf16-suffix`"].endswith(
        "| `suffix_tree_overlap` | random | 0.32.0 | h, 2026-12-01 "
        "| 64: 69 → 20; 8192: 190 → 180 | all (random weights: no verdict) "
        "| draft 28.1 → 0.5 |"
    )
    assert render_results.prefill_rows([random | {"gpu": "NVIDIA H100"}], "NVIDIA H200") == []


def test_a_row_names_the_patches_it_served_otherwise_than_todays_defaults():
    """A row measured before a default changed says what it ran with: from the resolved serve.patches of its record (a
    patch of its vLLM that the table lacks did not exist yet: off), or from a --serve-set table (the rest defaults)."""
    from serving.patches import PATCHES

    gpu_default_on = next(n for n, p in PATCHES.items() if p.platform == "cuda" and p.default)
    engine = PATCHES[gpu_default_on].vllm
    resolved = {name: patch.default for name, patch in PATCHES.items()}
    base = {"variant": "bf16", "engine": engine, "options": {"gpu_memory_utilization": 0.3}}

    def served(table, **options):
        return dict(base, serve={"patches": table}, options=dict(base["options"], **options))

    assert render_results.label(served(resolved)) == "`bf16` (gpu_memory_utilization: 0.3)"
    older = {name: on for name, on in resolved.items() if name != gpu_default_on}
    assert render_results.label(served(older)) == f"`bf16` (gpu_memory_utilization: 0.3, patches: {gpu_default_on} off)"
    asked = {gpu_default_on: True}  # --serve-set patches: the others at their defaults, nothing changed
    assert render_results.label(served(asked, serve_set={"patches": asked})) == "`bf16` (gpu_memory_utilization: 0.3)"
    # another engine's record: a patch written for this one could not have run there, so it is no change
    assert render_results.label(dict(served(older), engine="0.0.1")) == "`bf16` (gpu_memory_utilization: 0.3)"
    assert 'patches: "off"' in render_results.label(served(older, patches="off"))
    # a patch that acts on one speculative method only is no change on another method's row
    suffix_only = next(name for name, patch in PATCHES.items() if patch.methods == ("suffix",))
    without = dict(resolved, **{suffix_only: False})
    assert suffix_only not in render_results.label(dict(served(without), speculative={"method": "mtp"}))
    assert f"{suffix_only} off" in render_results.label(dict(served(without), speculative={"method": "suffix"}))
