"""The GPU proof (issue #7): the committed H100 records validate and agree with each other, and the driver
that wrote them runs its serve/bake/probe flow against a fake server (no GPU needed)."""

import hashlib
import json
import re
import shutil
import statistics
import struct
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import COMPRESS_PY

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "gpu-proof" / "h100"
SCHEMA = yaml.safe_load((ROOT / "schemas" / "gpu-proof.schema.yaml").read_text())
EXPECTED_VARIANTS = {"bf16", "awq-w4a16-g32-mlp", "awq-w4a16-g32-broad", "bf16-mtp1", "bf16-mtp2", "bf16-mtp4"}


def lease_records(folder: Path, pattern: str = "*.json") -> dict[str, dict]:
    """A lease folder's records by file stem (variant-<name>, lossless, session, ...)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob(pattern))}


def test_the_records_speculative_methods_are_the_settings_table_s():
    """A GPU-proof record's method is one the pipeline serves (serving/settings.py, the one home of the methods)."""
    from serving.settings import SPECULATIVE_METHODS

    methods = SCHEMA["$defs"]["variant"]["properties"]["speculative"]["properties"]["method"]["enum"]
    assert set(methods) <= set(SPECULATIVE_METHODS), set(methods) - set(SPECULATIVE_METHODS)


def assert_lease(found: dict[str, dict], *machines: str) -> None:
    """Every record of a lease folder valid against the schema and written on one of the lease's machines."""
    for name, data in found.items():
        jsonschema.validate(data, SCHEMA)
        assert data["kind"] == "session" or data["machine"] in machines, name


def runtime_row(record, name, set_name="fresh") -> dict:
    """A profile's runtime call `name` ({name, count, total_ms}) over the set's decode steps."""
    calls = record["profile"]["sets"][set_name]["breakdown"]["top_runtime"]
    return next(c for c in calls if c["name"] == name)


def runtime_calls(record, name, set_name="fresh"):
    return runtime_row(record, name, set_name)["count"]


def records() -> dict[str, dict]:
    return lease_records(RESULTS)


def by_kind(kind: str) -> dict[str, dict]:
    return {name: data for name, data in records().items() if data["kind"] == kind}


def test_the_records_exist_and_validate():
    found = records()
    assert {"session", "environment", "checkpoint", "bandwidth"} <= set(found), sorted(found)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    problems = [
        f"{name}: {error.json_path}: {error.message}"
        for name, data in found.items()
        for error in validator.iter_errors(data)
    ]
    assert not problems, "\n".join(problems)


def test_every_variant_is_measured_or_said_not_done():
    variants = {data["variant"]: data for data in by_kind("variant").values()}
    not_done = " ".join(item["what"] for item in records()["session"]["not_done"])
    for name in EXPECTED_VARIANTS:
        assert (name in variants and variants[name]["status"] == "ok") or name in not_done, name


def test_variants_have_the_three_categories_on_one_gpu():
    config = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    categories = config["properties"]["probe"]["properties"]["categories"]["default"]
    expected = [(c["name"], c["prompt_tokens"], c["output_tokens"]) for c in categories]
    gpus = {data["machine"]: data["gpu"]["name"] for data in by_kind("environment").values()}
    for data in by_kind("checkpoint").values():
        assert data["device"] == gpus[data["machine"]]
    for name, data in by_kind("variant").items():
        assert data["machine"] in gpus, name  # every variant ran on a machine whose environment is recorded
    for name, data in by_kind("variant").items():
        if data["status"] != "ok":
            continue
        sets = [data["probe"]["categories"]] + (
            [data["probe"]["varied"]["categories"]] if data["probe"]["varied"] else []
        )
        for categories_measured in sets:
            got = [(c["name"], c["prompt_tokens"], c["output_tokens_requested"]) for c in categories_measured]
            assert got == expected, name
            for category in categories_measured:
                assert category["output_tokens_mean"] == category["output_tokens_requested"], (name, category["name"])
                assert len(category["latencies_ms"]) == category["runs"] == data["probe"]["runs"]
                assert 0 < category["ttft_median_ms"] < category["median_ms"], (name, category["name"])
        mtp = data["speculative"]["k"] > 0
        for category in data["probe"]["categories"]:
            assert (category["mean_acceptance_length"] is not None) == mtp, (name, category["name"])


def test_decode_time_never_beats_the_bandwidth_bound():
    bandwidth = {data["machine"]: data["copy_gbps"] for data in by_kind("bandwidth").values()}
    for name, data in by_kind("variant").items():
        if data["status"] != "ok":
            continue
        decode = data["decode"]
        assert decode["bandwidth_gbps"] == bandwidth[data["machine"]]  # the bandwidth of the machine it ran on
        k = data["speculative"]["k"]
        weights = data["weights"]
        assert decode["weights_bytes_per_step"] == weights["decoder"] + weights["lm_head"] + k * (
            weights["mtp"] + weights["lm_head"]
        )
        for row in decode["categories"]:
            assert row["bound_with_kv_state_ms"] >= row["weights_bound_ms"] > 0
            assert row["fraction_of_bound"] <= 1.05, (name, row)  # a measurement faster than the bound is wrong


def test_quantized_variants_are_smaller_and_report_their_modules():
    quantized = by_kind("quantize")
    bf16 = records().get("variant-bf16")
    bundles = {
        env["machine"]: env["versions"]["llmcompressor_bundle"]["llmcompressor"]
        for env in by_kind("environment").values()
    }
    for name, data in quantized.items():
        if data["status"] != "ok":
            continue
        assert bundles[data["machine"]] == "0.14.0.1", name  # quantized where the bundle was unpacked
        report = data["report"]
        assert report["quantized"] and report["quantized_modules"] == report["checks"]["expected_quantized_modules"]
        assert report["checks"]["mtp_tensors"] > 0
        assert data["peak_gpu_memory_allocated_gib"] > 0
        served = records().get(f"variant-{data['variant']}")
        assert report["checks"]["weight_bytes"] == report["checks"]["expected_weight_bytes"]
        if served and bf16 and served["status"] == "ok":
            # MLP-only leaves attention and the linear-attention projections in BF16; broad packs them too
            limit = 0.6 if data["variant"].endswith("-mlp") else 0.5
            assert served["weights"]["decoder"] < bf16["weights"]["decoder"] * limit, data["variant"]


def test_the_baked_cache_starts_faster_than_an_empty_one():
    for name, data in by_kind("variant").items():
        cold = data["cold_start"]
        if "baked_cache_s" in cold and "empty_cache_s" in cold:
            assert cold["baked_cache_s"] < cold["empty_cache_s"], name


# ---- the driver's flow, against gpu_proof/fake_server.py ----


def fake_driver(tmp_path):
    """gpu_proof/driver.py's Driver serving gpu_proof/fake_server.py, with a checkpoint and bandwidth record."""
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    import driver

    d = driver.Driver(tmp_path, warmup=1, runs=2)
    d.serve_cmd = [sys.executable, str(ROOT / "gpu_proof" / "fake_server.py")]
    header = {
        "model.language_model.layers.0.mlp.up_proj.weight": [0, 1000],
        "lm_head.weight": [1000, 1500],
        "model.language_model.embed_tokens.weight": [1500, 2000],
        "mtp.fc.weight": [2000, 2100],
    }
    blob = json.dumps({n: {"dtype": "BF16", "shape": [1], "data_offsets": o} for n, o in header.items()}).encode()
    d.model_dir.mkdir(parents=True)
    (d.model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(2100))
    d.record(
        "checkpoint",
        {
            "text_config": {
                "full_attention_layers": 8,
                "linear_attention_layers": 24,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "linear_num_value_heads": 32,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
            }
        },
    )
    d.record("bandwidth", {"copy_gbps": 3000.0})
    return d


def test_driver_bakes_restarts_and_probes_against_a_fake_server(tmp_path):
    d = fake_driver(tmp_path)
    d.run_steps(["serve-bf16", "serve-bf16-mtp2"])
    bf16 = json.loads((tmp_path / "results" / "variant-bf16.json").read_text())
    mtp = json.loads((tmp_path / "results" / "variant-bf16-mtp2.json").read_text())
    assert bf16["status"] == mtp["status"] == "ok"
    assert bf16["cold_start"]["first_start_cache"] == "empty" and "baked_cache_s" in bf16["cold_start"]
    assert bf16["cold_start"]["cache_by_dir"]["vllm"]["files"] == 1
    assert mtp["cold_start"]["first_start_cache"] == "seeded"  # bf16's kernel caches, not its vllm/ dir
    assert "--gdn-prefill-backend" in bf16["vllm_args"] and "--language-model-only" in bf16["vllm_args"]
    assert '"num_speculative_tokens": 2' in " ".join(mtp["vllm_args"])
    assert [c["name"] for c in bf16["probe"]["categories"]] == ["short", "medium", "long"]
    assert bf16["probe"]["varied"] is not None and mtp["probe"]["varied"] is None
    assert mtp["decode"]["weights_bytes_per_step"] == 1000 + 500 + 2 * (100 + 500)
    assert (tmp_path / "done" / "serve-bf16").exists() and (tmp_path / "results.tar.gz").exists()
    # each start's kernel picks, read from its cache after it stopped: the seeded start kept bf16's
    from gpu_proof.driver import differing_picks

    assert list(bf16["kernel_picks"]["triton"].values()) == [
        {"key": [1], "config": {"kwargs": {"BLOCK": 128}, "num_warps": 4}}
    ]
    assert differing_picks(bf16["kernel_picks"], mtp["kernel_picks"])["triton"] == {"shared": 1, "differ": []}
    for record in (bf16, mtp):
        jsonschema.validate(record, SCHEMA)


def test_driver_runs_only_its_steps_in_the_order_given_with_the_run_serve_env(tmp_path):
    """A lease runs what matters most first (--only's order); --serve-env reaches every record; a misspelt step
    stops the driver before anything runs."""
    d = fake_driver(tmp_path)
    d.serve_env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    with pytest.raises(SystemExit, match="unknown steps"):
        d.run_steps(["serve-bf16", "serve-no-such-variant"])
    assert not list((tmp_path / "done").iterdir())
    d.run_steps(["serve-bf16-mtp2", "serve-bf16"])
    results = tmp_path / "results"
    mtp, bf16 = (json.loads((results / f"variant-{name}.json").read_text()) for name in ("bf16-mtp2", "bf16"))
    assert mtp["cold_start"]["first_start_cache"] == "empty"  # it ran before bf16 baked the cache it would seed from
    assert mtp["serve_env"] == bf16["serve_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_driver_runs_the_speculation_proof_with_its_lossless_check(tmp_path):
    """Issue 14's run: bf16 probed on its first start (no restart), AWQ with the lossless reference, a suffix variant
    on the same checkpoint, then the lossless step comparing the two."""
    d = fake_driver(tmp_path)
    quantized = tmp_path / "quant" / "awq-w4a16-g32-broad" / "model"
    shutil.copytree(d.model_dir, quantized)
    (quantized / "config.json").write_text("{}")
    d.run_steps(["serve-bf16-base", "serve-awq-broad", "serve-awq-broad-suffix24", "lossless"])
    results = tmp_path / "results"
    bf16, awq, suffix = (
        json.loads((results / f"variant-{name}.json").read_text())
        for name in ("bf16-base", "awq-broad", "awq-broad-suffix24")
    )
    assert bf16["probe"] is not None and "baked_cache_s" not in bf16["cold_start"]
    assert (tmp_path / "cache" / "bf16.tar").exists() and suffix["cold_start"]["first_start_cache"] == "seeded"
    assert [s for s in ("varied", "fresh") if suffix["probe"][s]] == ["varied", "fresh"]
    assert '"method": "suffix"' in " ".join(suffix["vllm_args"]) and suffix["speculative"]["k"] == 24
    assert suffix["decode"]["weights_bytes_per_step"] == 1000 + 500  # copy-style drafts read no weights
    assert all(c.get("first_run_top_logprobs") for c in awq["reference"]["categories"])
    assert "reference" not in suffix
    lossless = json.loads((results / "lossless.json").read_text())
    (check,) = lossless["checks"]
    assert check["variant"] == "awq-broad-suffix24" and check["reference_variant"] == "awq-broad"
    assert check["passed"] and len(check["rows"]) == 9 and all(row["tokens"] > 0 for row in check["rows"])


def test_decode_bound_counts_mtp_drafts_and_context():
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    import driver

    text = {
        "full_attention_layers": 8,
        "linear_attention_layers": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    }
    weights = {"decoder": 8e9, "lm_head": 1e9, "mtp": 2e8, "embed_tokens": 1e9, "vision": 0}
    category = {
        "name": "long",
        "prompt_tokens": 8192,
        "output_tokens_requested": 256,
        "itl_median_ms": 10.0,
        "mean_acceptance_length": 2.0,
    }
    out = driver.decode_bound(weights, 1, 1000.0, text, [category])
    row = out["categories"][0]
    assert out["weights_bytes_per_step"] == 8e9 + 1e9 + 1.2e9
    assert row["weights_bound_ms"] == pytest.approx(10.2 / 2)  # 10.2 GB at 1000 GB/s, two tokens a step
    kv = 8320 * 8 * 2 * 4 * 256 * 2
    state = 2 * 24 * 32 * 128 * 128 * 4
    assert row["bound_with_kv_state_ms"] == pytest.approx((10.2e9 + kv + state) / 1e12 * 1e3 / 2, rel=1e-3)


@pytest.mark.e2e  # the compress venv (torch, transformers)
def test_checkpoint_builder_runs_on_the_current_tiny_model_api(tmp_path, tiny_venvs):
    """The device-side builder uses scripts/lib/tiny; a change there broke it once on the H100
    (build_tiny_checkpoint began returning {"config", "training"}). Same script, small dims, on CPU."""
    import subprocess

    dims = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 4096,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    result = tmp_path / "checkpoint.json"
    subprocess.run(
        [
            str(tiny_venvs["compress"]),
            str(ROOT / "gpu_proof" / "build_checkpoint.py"),
            str(tmp_path / "model"),
            str(result),
            "--device",
            "cpu",
            "--dims",
            json.dumps(dims),
            "--vocab",
            "4160",
        ],
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    data = json.loads(result.read_text())
    assert data["text_config"]["hidden_size"] == 64 and data["text_config"]["vocab_size"] == 4160
    assert data["text_config"]["full_attention_layers"] == 1 and data["tensor_groups"]["mtp"]["tensors"] > 0
    shards = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    assert shards and sorted(data["weights_sha256"]) == shards
    assert (
        data["weights_sha256"][shards[0]] == hashlib.sha256((tmp_path / "model" / shards[0]).read_bytes()).hexdigest()
    )
    # the schema pins the real shapes, so a small record can only be checked for the keys it must carry
    required = set(SCHEMA["$defs"]["checkpoint"]["required"]) - {"command"}  # the driver adds the command
    assert required <= set(data), sorted(required - set(data))
    assert set(SCHEMA["$defs"]["checkpoint"]["properties"]["text_config"]["required"]) <= set(data["text_config"])


# ---- issue 14's run (results/gpu-proof/h100-spec): speculation on the H100 ----

SPEC_RESULTS = ROOT / "results" / "gpu-proof" / "h100-spec"


def spec_records() -> dict[str, dict]:
    return lease_records(SPEC_RESULTS)


def test_the_speculation_records_validate_and_name_their_lease():
    found = spec_records()
    assert {"session", "lossless", "variant-awq-broad", "variant-awq-broad-suffix24"} <= set(found)
    assert_lease(found, "machine5", "machine6")


@pytest.mark.parametrize(
    "lease",
    [
        "h100-spec",
        "h100-tied",
        "h100-suffix-depth",
        "h100-silent",
        "h100-ngram-gpu",
        "h100-graph-drafter",
        "h100-suffix-plugins",
        "h100-runner2-lossless",
    ],
)
def test_the_lossless_record_is_what_lib_lossless_says_of_the_variant_records(lease):
    """Recomputed from the variant records alone: the stored verdicts are the check's, not written by hand."""
    from lib.lossless import compare, failures

    found = lease_records(RESULTS.parent / lease)
    for check in found["lossless"]["checks"]:
        record = found[f"variant-{check['variant']}"]
        reference = found[f"variant-{check['reference_variant']}"]
        assert record["recipe"] == reference["recipe"] and reference["speculative"]["method"] == "none"
        rows = compare(record["probe"], reference["reference"])
        assert rows == check["rows"] and failures(rows) == check["failures"]
        assert check["passed"] == (not failures(rows))


def test_every_speculative_record_counts_its_drafts_per_set():
    for name, data in spec_records().items():
        if data["kind"] != "variant" or data["speculative"]["method"] == "none":
            continue
        for set_name in ("varied", "fresh"):
            assert data["probe"][set_name] is not None, (name, set_name)
        for category in data["probe"]["categories"] + data["probe"]["fresh"]["categories"]:
            assert category["spec_decode"]["drafts"] > 0, (name, category["name"])


def test_driver_profiles_a_decode_step_on_the_repeated_and_the_fresh_set(tmp_path):
    """Issues 15/14's profile variants: the server gets vLLM's --profiler-config through serve.json's extra_args,
    each set's short request is bracketed by /start_profile and /stop_profile, and the trace is broken down."""
    d = fake_driver(tmp_path)
    quantized = tmp_path / "quant" / "awq-w4a16-g32-broad" / "model"
    shutil.copytree(d.model_dir, quantized)
    (quantized / "config.json").write_text("{}")
    d.run_steps(["serve-awq-broad-profile"])
    record = json.loads((tmp_path / "results" / "variant-awq-broad-profile.json").read_text())
    assert record["status"] == "ok", record
    flag = record["vllm_args"].index("--profiler-config")
    assert json.loads(record["vllm_args"][flag + 1])["torch_profiler_dir"] == str(
        tmp_path / "profile" / "awq-broad-profile"
    )
    sets = record["profile"]["sets"]
    assert set(sets) == {"repeated", "fresh"}
    for entry in sets.values():
        families = entry["breakdown"]["families"]
        assert set(families) == {"marlin_gemm", "gdn_recurrence", "dense_gemm"}
        assert entry["breakdown"]["busy_ms"] == 1.8 and entry["breakdown"]["idle_ms"] == 0.1
        assert (tmp_path / "results" / entry["kept_as"]).exists()


def test_kernel_families_and_the_idle_time_between_steps():
    from gpu_proof.profile_breakdown import breakdown, kernel_family

    assert kernel_family("Marlin<256, 1, 8, 8, 4, 8>") == "marlin_gemm"
    assert kernel_family("void cutlass::device_kernel<machete::MacheteKernelTemplate<cutlass::bfloat16_t>>") == (
        "machete_gemm"
    )
    assert kernel_family("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert kernel_family("triton_poi_fused_mul_silu_slice_1") == "activation_elementwise"
    # inductor's kernels named after the GEMM op that feeds them are the norm or activation, not the GEMM
    assert kernel_family("triton_red_fused__to_copy_add_fused_add_rms_norm_marlin_gemm_3") == "norm"
    assert kernel_family("triton_poi_fused_marlin_gemm_mul_silu_slice_4") == "activation_elementwise"
    assert kernel_family("triton_poi_fused_forward_functional_mul_silu_slice_4") == "activation_elementwise"
    assert kernel_family("void marlin::Marlin<1125899906909960l, 256, 1, 8, 8, true, 4, 2, false>") == "marlin_gemm"
    for gemlite in ("gemv_INT_revsplitK_kernel", "gemm_splitK_INT_kernel", "gemm_INT_kernel"):
        assert kernel_family(gemlite) == "gemlite_gemm", gemlite
    assert kernel_family("_causal_conv1d_update_kernel") == "causal_conv1d"
    assert kernel_family("fused_recurrent_gated_delta_rule_fwd_kernel") == "gdn_recurrence"
    assert kernel_family("fused_sigmoid_gating_delta_rule_update_kernel") == "gdn_recurrence"  # spec verify path
    assert kernel_family("flash_fwd_splitkv_kernel") == "attention"
    assert kernel_family("something_new") == "other"
    events = [
        {"ph": "X", "cat": "kernel", "name": "Marlin<>", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "Marlin<>", "ts": 300, "dur": 200},  # overlaps: busy counts it once
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1500, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0, "dur": 2000},
    ]
    result = breakdown({"traceEvents": events}, steps=2)
    assert result["window_ms"] == 2.0 and result["busy_ms"] == 1.0 and result["idle_ms"] == 1.0
    assert result["per_step"]["idle_ms"] == 0.5 and result["idle_gaps"][">=1000us"]["count"] == 1
    assert result["families"]["marlin_gemm"] == {
        "total_ms": 0.6,
        "count": 2,
        "per_step_ms": 0.3,
        "share_of_busy": 0.5455,
    }
    assert result["top_annotations"][0]["name"] == "execute_model"
    with pytest.raises(ValueError, match="no GPU events"):
        breakdown({"traceEvents": events[-1:]}, steps=1)


PROFILE_RESULTS = ROOT / "results" / "gpu-proof" / "h100-profile"


def profile_records() -> dict[str, dict]:
    return lease_records(PROFILE_RESULTS)


def test_the_profile_records_validate_and_agree_with_their_bytes():
    """Issue 15's lease: AWQ broad and AWQ with the int4 head, profiled. The head's bytes fell as packed int4 with
    group-32 scales does, and the head's bf16 GEMM left the profile for Marlin's."""
    found = profile_records()
    assert {"session", "variant-awq-broad-profile", "variant-awq-broad-head4"} <= set(found)
    assert_lease(found, "machine7")
    awq, head4 = found["variant-awq-broad-profile"], found["variant-awq-broad-head4"]
    rows, cols = 248320, 2560
    assert awq["weights"]["lm_head"] == rows * cols * 2
    assert head4["weights"]["lm_head"] == rows * cols // 2 + rows * cols // 32 * 2 + 16  # packed + scales + shape
    assert {k: v for k, v in awq["weights"].items() if k != "lm_head"} == {
        k: v for k, v in head4["weights"].items() if k != "lm_head"
    }
    for set_name in ("repeated", "fresh"):
        before = awq["profile"]["sets"][set_name]["breakdown"]
        after = head4["profile"]["sets"][set_name]["breakdown"]
        assert after["families"]["dense_gemm"]["count"] < before["families"]["dense_gemm"]["count"]
        assert after["families"]["marlin_gemm"]["count"] > before["families"]["marlin_gemm"]["count"]
        assert after["per_step"]["busy_ms"] < before["per_step"]["busy_ms"]
        for breakdown in (before, after):  # kernel time of the families covers the busy time (overlaps count twice)
            kernels = sum(f["total_ms"] for f in breakdown["families"].values())
            assert kernels >= breakdown["busy_ms"] * 0.999 and breakdown["window_ms"] >= breakdown["busy_ms"]


# ---- the tied checkpoint's leases (results/gpu-proof/h100-tied): padded drafts, smaller heads ----

TIED_RESULTS = ROOT / "results" / "gpu-proof" / "h100-tied"


def test_the_tied_records_validate_and_their_head_bytes_match_a_hand_count():
    found = lease_records(TIED_RESULTS)
    assert_lease(found, "machine8", "machine9")
    rows, cols, kept = 248320, 2560, 131072
    awq, vocab, head8 = (
        found[f"variant-awq-broad-{name}"]["weights"] for name in ("all-profile", "head4-vocab131k", "head8-tied")
    )
    assert awq["lm_head"] == 0 and awq["embed_tokens"] == rows * cols * 2  # tied: the embedding is the head
    assert vocab["embed_tokens"] == kept * cols * 2
    assert vocab["lm_head"] == kept * cols // 2 + kept * cols // 32 * 2 + 16  # int4 + group-32 bf16 scales + shape
    assert head8["lm_head"] == rows * cols + rows * 2 + 16  # int8 + one bf16 scale per row + shape
    assert awq["decoder"] == vocab["decoder"] == head8["decoder"]
    for recipe in ("awq-broad-head4-vocab131k", "awq-broad-head8"):
        head = found[f"quantize-{recipe}"]["report"]["head"]
        assert head["tied_in_source"] and head["untied"] and head["quantized"], recipe
    assert found["quantize-awq-broad-head4-vocab131k"]["report"]["vocab"]["rows"] == kept


def test_padded_suffix_drafts_on_every_step_and_is_compared_with_bf16_on_its_own_host():
    """With pad_drafts every decode step after the first carries a K-token draft, so on fresh prompts (nothing
    accepted) the drafts counted are runs x (output tokens - 1); bf16 ran on the same lease as the factor-4 run."""
    found = lease_records(TIED_RESULTS, "variant-*.json")
    assert found["variant-bf16-all"]["machine"] == found["variant-awq-broad-suffix24-pad-f4"]["machine"]
    for name in ("variant-awq-broad-suffix24-pad-profile", "variant-awq-broad-suffix24-pad-f4"):
        probe = found[name]["probe"]
        assert found[name]["speculative"]["pad_drafts"] is True
        for category in probe["fresh"]["categories"]:
            assert category["spec_decode"]["accepted_tokens"] == 0, (name, category["name"])
            assert category["spec_decode"]["drafts"] == probe["runs"] * (category["output_tokens_mean"] - 1)
        assert all(c["mean_acceptance_length"] > 1 for c in probe["categories"]), name


# ---- suffix decoding's tree depth (results/gpu-proof/h100-suffix-depth) ----

DEPTH_RESULTS = ROOT / "results" / "gpu-proof" / "h100-suffix-depth"


def test_a_deeper_suffix_tree_drafts_past_the_default_cap_beside_bf16_on_its_own_host():
    """vLLM's suffix tree depth (24 by default) bounds match + draft, so K=24 accepted at most 24 tokens a step
    (h100-tied); depth 64 with K=48 accepts more than that on the repeated set. bf16 ran on the same lease."""
    found = lease_records(DEPTH_RESULTS)
    assert_lease(found, "machine10")
    shallow = json.loads((TIED_RESULTS / "variant-awq-broad-suffix24-pad-f4.json").read_text())
    assert "suffix_decoding_max_tree_depth" not in shallow["speculative"]
    assert all(c["mean_acceptance_length"] <= 24 for c in shallow["probe"]["categories"])
    for name in ("awq-broad-suffix48-d64-pad-f4", "awq-broad-suffix48-d64-pad-f4-prefix"):
        deep = found[f"variant-{name}"]
        assert deep["machine"] == found["variant-bf16-all"]["machine"]
        assert deep["speculative"]["k"] == 48 and deep["speculative"]["suffix_decoding_max_tree_depth"] == 64
        assert all(c["mean_acceptance_length"] > 25 for c in deep["probe"]["categories"]), name
        for category in deep["probe"]["fresh"]["categories"]:  # padded: a 48-token draft on every step
            assert category["spec_decode"]["drafts"] == deep["probe"]["runs"] * (category["output_tokens_mean"] - 1)
    prefix = found["variant-awq-broad-suffix48-d64-pad-f4-prefix"]
    assert prefix["serve_settings"]["enable_prefix_caching"] is True
    long = next(c for c in prefix["probe"]["categories"] if c["name"] == "long")
    assert long["prefix_cache"]["hit_rate"] > 0.9
    # with prefix caching on, the repeated long prompt's greedy output left the reference without a near tie: the
    # reason config refuses suffix + prefix caching (serving/settings.py PREFIX_CACHING_UNSAFE)
    check = next(c for c in found["lossless"]["checks"] if c["variant"] == prefix["variant"])
    assert any(r["set"] == "repeated" and r["category"] == "long" and not r["passed"] for r in check["rows"])


def test_the_second_host_reran_depth_64_and_put_group_128_on_marlin_by_its_own_server_env():
    """machine11: bf16 beside the suffix runs again; group 128 served with Machete disabled uses Marlin (its GEMMs
    in the marlin family), where machine10's group 128 went to Machete (no Marlin kernel in its step)."""
    rerun = lease_records(RESULTS.parent / "h100-suffix-depth-rerun")
    assert_lease(rerun, "machine11")
    assert {
        "variant-bf16-all",
        "variant-awq-broad-suffix48-d64-pad-f4",
        "variant-awq-broad-suffix32-d48-pad-f4",
    } <= set(rerun)
    marlin = rerun["variant-awq-w4a16-g128-marlin"]
    assert marlin["serve_env"]["VLLM_DISABLED_KERNELS"] == "MacheteLinearKernel"
    machete = json.loads((DEPTH_RESULTS / "variant-awq-w4a16-g128-broad.json").read_text())
    assert "VLLM_DISABLED_KERNELS" not in machete["serve_env"]
    marlin_families = marlin["profile"]["sets"]["repeated"]["breakdown"]["families"]
    machete_families = machete["profile"]["sets"]["repeated"]["breakdown"]["families"]
    assert marlin_families["marlin_gemm"]["per_step_ms"] > 1 and "marlin_gemm" not in machete_families
    assert machete_families["dense_gemm"]["per_step_ms"] > marlin_families["dense_gemm"]["per_step_ms"] + 1
    for name in ("awq-broad-suffix48-d64-pad-f4", "awq-broad-suffix32-d48-pad-f4"):
        depth = rerun[f"variant-{name}"]["speculative"]["suffix_decoding_max_tree_depth"]
        assert all(c["mean_acceptance_length"] <= depth for c in rerun[f"variant-{name}"]["probe"]["categories"])


# ---- silent drafts (results/gpu-proof/h100-silent) ----


def test_silent_drafts_replay_full_one_token_graphs_and_cost_less_than_padding_on_fresh_prompts():
    """machine12: with silent_drafts the server captured FULL graphs for 1-token decodes and dispatched a no-draft
    step to one; on fresh prompts (nothing accepted) a token costs less than with every draft padded to K, and more
    than a plain AWQ step (async scheduling stays off with suffix in vLLM 0.26)."""
    found = lease_records(RESULTS.parent / "h100-silent")
    assert_lease(found, "machine12")
    silent, padded = found["variant-awq-broad-silent32-d48-f4"], found["variant-awq-broad-suffix32-d48-pad-f4"]
    plain = found["variant-awq-broad"]
    assert silent["speculative"]["silent_drafts"] is True and not silent["speculative"].get("pad_drafts")
    log = (RESULTS.parent / "h100-silent" / "logs" / "machine12-awq-broad-silent32-d48-f4-first.log").read_text()
    assert "silent drafts: no-draft step -> FULL BatchDescriptor(num_tokens=1, num_reqs=1, uniform=True" in log

    def itl(record):
        return [c["itl_median_ms"] for c in record["probe"]["fresh"]["categories"]]

    assert all(c["mean_acceptance_length"] == 1.0 for c in silent["probe"]["fresh"]["categories"])
    assert all(p < q for p, q in zip(itl(plain), itl(silent), strict=True)) and all(
        s < p for s, p in zip(itl(silent), itl(padded), strict=True)
    )


# ---- ngram_gpu (results/gpu-proof/h100-ngram-gpu) ----


def test_ngram_gpu_keeps_async_scheduling_and_padding_makes_its_silent_step_cheaper_but_not_plain():
    """machine13: vLLM left async scheduling on for ngram_gpu; with pad_drafts the plugin was in the engine and every
    step replayed one graph; on fresh prompts (nothing accepted) a padded token costs less than vLLM's trimmed one
    and more than a plain AWQ token."""
    folder = RESULTS.parent / "h100-ngram-gpu"
    found = lease_records(folder)
    assert_lease(found, "machine13")
    plain, padded = found["variant-awq-broad"], found["variant-awq-broad-ngramgpu4-pad"]
    shipped = found["variant-awq-broad-ngramgpu4"]
    assert padded["speculative"] == {
        "method": "ngram_gpu",
        "k": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "pad_drafts": True,
    }
    for variant, padding in ((padded, True), (shipped, False)):
        log = (folder / "logs" / f"machine13-{variant['variant']}-first.log").read_text()
        assert "Asynchronous scheduling is enabled." in log and "Async scheduling not supported" not in log
        assert ("draft padding: ngram and suffix drafts padded to K" in log) == padding

    def itl(record):
        return [c["itl_median_ms"] for c in record["probe"]["fresh"]["categories"]]

    assert all(c["mean_acceptance_length"] == 1.0 for c in padded["probe"]["fresh"]["categories"])
    assert all(p < q < r for p, q, r in zip(itl(plain), itl(padded), itl(shipped), strict=True))
    graph_launches = {
        name: runtime_calls(record, "cudaGraphLaunch") for name, record in (("padded", padded), ("shipped", shipped))
    }
    assert graph_launches["padded"] == 127 and graph_launches["shipped"] > 127 * 10  # one FULL graph vs pieces


# ---- drafter graphs (results/gpu-proof/h100-graph-drafter) ----

GPU_PROOF_DOC = ROOT / "docs" / "gpu-proof.md"
SETS = ("repeated", "varied", "fresh")
BROAD_RECIPE = "recipes/awq-w4a16-g32-broad.yaml"


def set_categories(record, set_name):
    probe = record["probe"]
    return probe["categories"] if set_name == "repeated" else probe[set_name]["categories"]


def mean_itl(record, set_name="fresh"):
    return statistics.mean(c["itl_median_ms"] for c in set_categories(record, set_name))


def doc_row(section: str, label: str) -> list[str]:
    """The cells of the docs/gpu-proof.md table row labelled `label` in the section whose heading has `section`."""
    text = GPU_PROOF_DOC.read_text()
    start = text.index(section)
    line = next(line for line in text[start:].splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def per_step(record, families=None) -> str:
    """GPU time a decode step on the repeated set's profile, in ms: all kernel families, or those in `families`."""
    fam = record["profile"]["sets"]["repeated"]["breakdown"]["families"]
    return f"{sum(v['per_step_ms'] for k, v in fam.items() if families is None or k in families):.3f}"


def medians(record, set_name) -> str:
    return " / ".join(str(round(c["median_ms"])) for c in set_categories(record, set_name))


def speedup_over(base, record, set_name) -> float:
    """`record`'s mean speedup over `base` on one prompt set: the mean over categories of base's median over its own,
    the competition's measure."""
    return statistics.mean(
        b["median_ms"] / c["median_ms"]
        for b, c in zip(set_categories(base, set_name), set_categories(record, set_name), strict=True)
    )


def span(values, digits: int = 2) -> str:
    """The lowest and highest of `values`, as the docs write a range."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def set_cells(section: str, label: str, record, bf16) -> list[str]:
    """The docs row `label` of `section`, its per-set cells checked against `record`: medians, and the speedup over
    `bf16` of the same host (mean over categories) where a cell gives one. Returns the row's cells."""
    cells = doc_row(section, label)
    for cell, set_name in zip(cells, SETS, strict=False):
        assert cell.startswith(medians(record, set_name)), (label, set_name, cell)
        speedup = speedup_over(bf16, record, set_name)
        assert "x" not in cell or f"{speedup:.2f}x" in cell, (label, set_name, cell)
    return cells


def itl_cells(section: str, label: str, record, plain, bf16=None) -> None:
    """The docs row `label` of `section` against `record`: per-set medians (and with `bf16` the speedup over it, as
    set_cells checks), per-set mean ITL, and its ratio to `plain`'s (AWQ broad of the same host; "-" in plain's own
    row)."""
    if bf16 is None:
        cells = doc_row(section, label)
        assert cells[:3] == [medians(record, set_name) for set_name in SETS], label
    else:
        cells = set_cells(section, label, record, bf16)
    assert cells[3] == " / ".join(f"{mean_itl(record, s):.2f}" for s in SETS) + " ms", label
    ratios = " / ".join(f"{mean_itl(record, s) / mean_itl(plain, s):.2f}" for s in SETS)
    assert cells[4] == ("-" if record is plain else f"{ratios}x"), label


def assert_plugins_on(*records) -> None:
    """No serving plugin switched off (a SERVING_* variable) in these records' server environment: their default."""
    for record in records:
        assert not any(key.startswith("SERVING_") for key in record["serve_env"]), record["variant"]


def lossless_pairs_passed(found) -> dict[str, int]:
    """How many set/category pairs each checked variant of a lease's lossless record passed."""
    return {check["variant"]: sum(row["passed"] for row in check["rows"]) for check in found["lossless"]["checks"]}


def test_drafter_graphs_turn_ngram_gpus_eager_launches_into_two_graph_launches_and_a_cheaper_token():
    """machine14: with graph_drafter the padded ngram_gpu step replays two more graphs (bookkeeping, matcher + fill)
    instead of ~48 eager kernel launches (what the latencies came to: the docs test below); lossless against AWQ's
    reference on all nine pairs."""
    folder = RESULTS.parent / "h100-graph-drafter"
    found = lease_records(folder)
    assert_lease(found, "machine14")
    padded, graphed = found["variant-awq-broad-ngramgpu4-pad"], found["variant-awq-broad-ngramgpu4-pad-graph"]
    assert graphed["speculative"] == {**padded["speculative"], "graph_drafter": True}
    log = (folder / "logs" / "machine14-awq-broad-ngramgpu4-pad-graph-first.log").read_text()
    assert "Asynchronous scheduling is enabled." in log and "failed, eager for this shape" not in log
    for call in ("propose", "update_token_ids_ngram"):
        assert f"drafter graphs: captured {call} for (1, ((1, 5), 'torch.int32'))" in log

    steps = graphed["profile"]["sets"]["fresh"]["breakdown"]["steps"]
    assert runtime_calls(padded, "cudaGraphLaunch") == steps - 1  # the model's FULL graph, once a decode step
    assert runtime_calls(graphed, "cudaGraphLaunch") == steps - 1 + 2 * steps  # and the drafter's two
    assert runtime_calls(padded, "cudaLaunchKernel") - runtime_calls(graphed, "cudaLaunchKernel") > 40 * steps

    check = next(c for c in found["lossless"]["checks"] if c["variant"] == graphed["variant"])
    assert check["passed"] and len(check["rows"]) == 9


def test_the_drafter_graphs_section_of_the_docs_is_its_records():
    """docs/gpu-proof.md's machine14 table and its per-set ITL claims, recomputed from the variant records: medians,
    the speedup over bf16 of the same host (mean over categories), the fresh set's ITL range."""
    found = lease_records(RESULTS.parent / "h100-graph-drafter")
    bf16 = found["variant-bf16-all"]
    rows = {
        "bf16": bf16,
        "AWQ broad": found["variant-awq-broad"],
        "AWQ + ngram_gpu K=4, padded, drafter graphs": found["variant-awq-broad-ngramgpu4-pad-graph"],
        "AWQ + ngram_gpu K=4, padded, uncaptured": found["variant-awq-broad-ngramgpu4-pad"],
    }
    section = "# Drafter graphs: ngram_gpu's step captured"
    for label, record in rows.items():
        cells = set_cells(section, label, record, bf16)
        fresh_itl = [c["itl_median_ms"] for c in set_categories(record, "fresh")]
        assert cells[3] == f"{min(fresh_itl):.1f}-{max(fresh_itl):.1f}", label

    def set_range(record):
        return span([mean_itl(record, set_name) for set_name in SETS], 1)

    text = GPU_PROOF_DOC.read_text()
    graphed, padded = (
        rows["AWQ + ngram_gpu K=4, padded, drafter graphs"],
        rows["AWQ + ngram_gpu K=4, padded, uncaptured"],
    )
    assert f"mean ITL falls from {set_range(padded)} ms to {set_range(graphed)} ms" in text
    ratios = [mean_itl(graphed, s) / mean_itl(rows["AWQ broad"], s) for s in SETS]
    assert f"still costs **{span(ratios, 1)}x** a plain AWQ token" in text


def test_the_captured_step_is_host_bound_by_vllms_speculative_path_at_k4_and_k16():
    """machine15: the captured K=4 and K=16 steps both replay the drafter's two graphs with no failed capture; a
    step's GPU work grows with K (5 and 17 verified tokens); the docs' table is the records' medians, mean ITL and
    GPU time; the operator summaries (trace_ops.py) show the CPU-side sums the plain step does not make."""
    folder = RESULTS.parent / "h100-graph-drafter-traced"
    found = lease_records(folder, "[!h]*.json")
    assert_lease(found, "machine15")
    plain = found["variant-awq-broad-all-profile"]
    k4, k16 = (
        found["variant-awq-broad-ngramgpu4-pad-graph-traced"],
        found["variant-awq-broad-ngramgpu16-pad-graph-traced"],
    )
    assert k16["speculative"]["k"] == 16 and k4["speculative"]["graph_drafter"] and k16["speculative"]["graph_drafter"]
    busy = {
        name: record["profile"]["sets"]["fresh"]["breakdown"]["per_step"]["busy_ms"]
        for name, record in (("plain", plain), ("k4", k4), ("k16", k16))
    }
    for record in (k4, k16):
        log = (folder / "logs" / f"machine15-{record['variant']}-first.log").read_text()
        assert log.count("drafter graphs: captured") == 4 and "failed, eager for this shape" not in log
    assert busy["plain"] < busy["k4"] < busy["k16"]

    section = "## Where the captured step's host time goes"
    for label, name, record in (
        ("AWQ broad", "plain", plain),
        ("ngram_gpu K=4, padded, graphs", "k4", k4),
        ("ngram_gpu K=16, padded, graphs", "k16", k16),
    ):
        cells = doc_row(section, label)
        assert cells[:3] == [medians(record, set_name) for set_name in SETS], label
        ratio = "" if record is plain else f" ({mean_itl(record) / mean_itl(plain):.1f}x)"
        assert cells[3] == f"{mean_itl(record):.2f} ms{ratio}", label
        assert cells[4] == f"{busy[name]:.2f} ms", label
    for set_name in ("fresh", "repeated"):
        ops = json.loads((folder / f"host-ops-{set_name}.json").read_text())
        assert ops["steps"] == {"plain": 128, "speculative": 128}
        rows = {row["op"]: row for row in ops["largest_differences"]}
        assert rows["aten::sum"]["plain"]["calls"] == 0 and rows["aten::sum"]["speculative"]["calls"] > 15
        top = ops["top_level_ms_per_step"]
        assert top["speculative"] > 3 * top["plain"]


def test_trace_ops_counts_each_threads_outermost_operators_per_decode_step():
    from gpu_proof.trace_ops import compare, top_level_ops

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    def step(ts):
        return op("execute_context_0(0)_generation_1(1)", ts, 50, cat="user_annotation")

    events = [step(0), step(100), step(200)]
    events += [op("aten::index", 10, 20), op("aten::copy_", 12, 5), op("aten::index", 110, 20), op("aten::to", 150, 8)]
    events += [op("aten::sum", 160, 4, tid=2), op("aten::fill_", 250, 1)]  # another thread; after the last step
    found = top_level_ops(events)
    assert found == {"steps": 2, "ops": {"aten::index": [2, 40.0], "aten::to": [1, 8.0], "aten::sum": [1, 4.0]}}
    plain = {"steps": 2, "ops": {"aten::index": [2, 20.0]}}
    table = compare(plain, found)
    assert table["top_level_ms_per_step"] == {"plain": 0.01, "speculative": 0.026}
    assert [row["op"] for row in table["largest_differences"]] == ["aten::index", "aten::to", "aten::sum"]
    assert table["largest_differences"][0]["speculative"] == {"calls": 1.0, "ms": 0.02}


def test_gdn_metadata_from_slices_section_is_its_records():
    """machine16: the slices' log line only where the plugin is on; the docs' table is the records' medians, speedups
    over bf16 of the host, fresh mean ITL against AWQ broad's and GPU busy time; the per-set cost of a silent token
    and the operator summaries' claims (the GDN builder's CPU sums and syncs gone) recomputed."""
    folder = RESULTS.parent / "h100-gdn-metadata"
    found = lease_records(folder, "[!h]*.json")
    assert_lease(found, "machine16")
    bf16, plain = found["variant-bf16-all"], found["variant-awq-broad"]
    slices, vllm_build = (found[f"variant-awq-broad-ngramgpu4-{name}-traced"] for name in ("gdn", "vllmgdn"))
    assert slices["speculative"] == vllm_build["speculative"] and slices["speculative"]["graph_drafter"]
    assert (
        vllm_build["serve_env"]["SERVING_GDN_SPEC_METADATA"] == "0"
        and "SERVING_GDN_SPEC_METADATA" not in (slices["serve_env"])
    )
    for record, count in ((slices, 1), (vllm_build, 0)):
        log = (folder / "logs" / f"machine16-{record['variant']}-first.log").read_text()
        assert log.count("gdn spec metadata: all-speculative batch") == count

    section = "# GDN metadata from slices"
    rows = {
        "bf16": bf16,
        "AWQ broad": plain,
        "AWQ + ngram_gpu K=4, padded, graphs, vLLM's GDN build": vllm_build,
        "AWQ + ngram_gpu K=4, padded, graphs, GDN from slices": slices,
    }
    for label, record in rows.items():
        cells = set_cells(section, label, record, bf16)
        ratio = "" if record in (bf16, plain) else f" ({mean_itl(record) / mean_itl(plain):.2f}x)"
        assert cells[3] == f"{mean_itl(record):.2f} ms{ratio}", label
        if record.get("profile"):
            assert cells[4] == f"{record['profile']['sets']['fresh']['breakdown']['per_step']['busy_ms']:.2f} ms"

    text = GPU_PROOF_DOC.read_text()
    assert f"now costs {ratio_range(slices, plain)} a plain AWQ token" in text
    assert f"against {ratio_range(vllm_build, plain)} with vLLM" in text
    for set_name in ("fresh", "repeated"):
        ops = json.loads((folder / f"host-ops-{set_name}.json").read_text())
        assert ops["steps"] == {"vllm_build": 128, "slices": 128}
        top = ops["top_level_ms_per_step"]
        assert f"{top['vllm_build']:.2f} → {top['slices']:.2f} ms on the {set_name} set" in text
        by_op = {row["op"]: row for row in ops["largest_differences"]}
        assert by_op["aten::sum"]["vllm_build"]["calls"] > 15 >= 1 >= by_op["aten::sum"]["slices"]["calls"]


def test_kept_spec_decode_indices_section_is_its_records():
    """machine17: both plugins' log lines where on, the docs' table (medians, per-set mean ITL, the ratio to AWQ
    broad's) recomputed from the records, and the pins the kept indices remove counted in both traces' summaries."""
    folder = RESULTS.parent / "h100-spec-indices"
    found = lease_records(folder, "[!h]*.json")
    assert_lease(found, "machine17")
    plain = found["variant-awq-broad"]
    kept, slices = (found[f"variant-awq-broad-ngramgpu4-{name}-traced"] for name in ("idx", "gdn"))
    assert (
        slices["serve_env"]["SERVING_SPEC_DECODE_INDICES"] == "0"
        and "SERVING_SPEC_DECODE_INDICES" not in (kept["serve_env"])
    )
    section = "## The verify step's indices kept per batch shape"
    for label, record in (
        ("AWQ broad", plain),
        ("AWQ + ngram_gpu K=4, padded, graphs, GDN slices", slices),
        ("AWQ + ngram_gpu K=4, padded, graphs, GDN slices, kept indices", kept),
    ):
        log = (folder / "logs" / f"machine17-{record['variant']}-first.log").read_text()
        assert log.count("gdn spec metadata: all-speculative batch") == (record is not plain)
        itl_cells(section, label, record, plain)
    for set_name in ("fresh", "repeated"):
        ops = json.loads((folder / f"host-ops-{set_name}.json").read_text())
        assert ops["steps"] == {"gdn_slices": 128, "kept_indices": 128}
        pins = next(row for row in ops["largest_differences"] if row["op"] == "aten::pin_memory")
        assert pins["gdn_slices"]["calls"] == 5.0 and pins["kept_indices"]["calls"] == 0.0


def test_greedy_rejection_section_is_its_records():
    """machine18: the docs' table (medians, per-set mean ITL, the ratio to AWQ broad's) recomputed from the records,
    vLLM's sampler switched off by the plugin's own variable in one record only, the operators the plugin removes
    counted in both traces' summaries, and the lossless pairs each form passed."""
    from serving.greedy_rejection import ENV

    folder = RESULTS.parent / "h100-greedy-rejection"
    found = lease_records(folder, "[!h]*.json")
    assert_lease(found, "machine18")
    plain, bf16 = found["variant-awq-broad"], found["variant-bf16-all"]
    greedy, vllm = (found[f"variant-awq-broad-ngramgpu4-{name}-traced"] for name in ("greedy", "vllmsampler"))
    assert vllm["serve_env"][ENV] == "0" and ENV not in greedy["serve_env"]
    section = "## The greedy rejection sampler as argmaxes"
    for label, record in (
        ("bf16", bf16),
        ("AWQ broad", plain),
        ("AWQ + ngram_gpu K=4, padded, graphs, GDN slices, kept indices, vLLM's rejection sampler", vllm),
        ("AWQ + ngram_gpu K=4, padded, graphs, GDN slices, kept indices, greedy argmaxes", greedy),
    ):
        itl_cells(section, label, record, plain)
    for set_name in ("fresh", "repeated"):
        ops = json.loads((folder / f"host-ops-{set_name}.json").read_text())
        assert ops["steps"] == {"vllm_sampler": 128, "greedy_argmax": 128}
        by_op = {row["op"]: row for row in ops["largest_differences"]}
        # the bonus tokens' two float32 copies and the target rows' copy, and the clone of those
        assert by_op["aten::to"]["vllm_sampler"]["calls"] - by_op["aten::to"]["greedy_argmax"]["calls"] == 4.0
        assert by_op["aten::clone"]["vllm_sampler"]["calls"] - by_op["aten::clone"]["greedy_argmax"]["calls"] == 1.0
    assert lossless_pairs_passed(found) == {greedy["variant"]: 8, vllm["variant"]: 6}


def test_suffix_with_every_plugin_section_is_its_records():
    """machine19: padded and silent suffix K=32 depth 48 with the plugins on by default (no plugin switched off in
    any record), the docs' table (medians, speedup over bf16, per-set mean ITL, ratio to AWQ broad's) recomputed from
    the records, acceptance where the docs claim it, and the lossless pairs each form passed."""
    folder = RESULTS.parent / "h100-suffix-plugins"
    found = lease_records(folder)
    assert_lease(found, "machine19")
    plain, bf16 = found["variant-awq-broad"], found["variant-bf16-all"]
    padded, silent = found["variant-awq-broad-suffix32-d48-pad-f4"], found["variant-awq-broad-silent32-d48-f4"]
    assert padded["speculative"]["pad_drafts"] and silent["speculative"]["silent_drafts"]
    assert_plugins_on(padded, silent)
    section = "# Suffix decoding with every plugin"
    for label, record in (
        ("bf16", bf16),
        ("AWQ broad", plain),
        ("AWQ + suffix K=32, depth 48, padded, every plugin", padded),
        ("AWQ + suffix K=32, depth 48, silent, every plugin", silent),
    ):
        itl_cells(section, label, record, plain, bf16)
    accepted = [c["mean_acceptance_length"] for c in set_categories(padded, "repeated")]
    assert min(accepted) >= 25.8 and all(c["mean_acceptance_length"] == 1.0 for c in set_categories(padded, "fresh"))
    log = (folder / "logs" / f"machine19-{padded['variant']}-first.log").read_text()
    assert "gdn spec metadata: all-speculative batch of 8 built from slices" in log
    assert lossless_pairs_passed(found) == {padded["variant"]: 5, silent["variant"]: 7}


def test_the_mtp_default_section_is_its_records():
    """machine20-21: the real default (MTP K=2 on AWQ broad) with the plugins on (their default) and off, K=4, and
    K=2 on the pruned vocabulary's int4 head: the docs' tables recomputed from the records, the plugins' greedy ids
    equal to vLLM's own paths' on every pair, nothing accepted on random weights, the head shared with the drafter."""
    from serving.gdn_spec_metadata import ENV as GDN_SLICES
    from serving.greedy_rejection import ENV as GREEDY
    from serving.spec_decode_indices import ENV as KEPT_INDICES

    folder = RESULTS.parent / "h100-mtp"
    found = lease_records(folder)
    assert_lease(found, "machine20", "machine21")
    plain = found["variant-awq-broad"]
    plugins, vllm, k4 = (found[f"variant-awq-broad-mtp{name}"] for name in ("2-plugins", "2-vllm", "4-plugins"))
    pruned, pruned_plain = found["variant-awq-broad-vocab131k-mtp2"], found["variant-awq-broad-vocab131k-plain"]
    assert all(vllm["serve_env"][env] == "0" for env in (GDN_SLICES, KEPT_INDICES, GREEDY))
    assert_plugins_on(plugins, k4, pruned)
    section = "# The real default: MTP on AWQ broad"
    for label, record in (
        ("AWQ broad", plain),
        ("AWQ + MTP K=2, every plugin", plugins),
        ("AWQ + MTP K=2, vLLM's own paths", vllm),
        ("AWQ + MTP K=4, every plugin", k4),
    ):
        itl_cells(section, label, record, plain)
    for record in (plugins, vllm, k4, pruned):
        assert all(c["mean_acceptance_length"] == 1.0 for s in SETS for c in set_categories(record, s))
    for s in SETS:  # the plugins change no output: the same greedy ids as vLLM's own paths, pair by pair
        pairs = zip(set_categories(plugins, s), set_categories(vllm, s), strict=True)
        assert all(a["first_run_token_ids"] == b["first_run_token_ids"] for a, b in pairs), s
    assert lossless_pairs_passed(found) == {plugins["variant"]: 6, vllm["variant"]: 6}

    columns = [plugins, k4, pruned]
    assert doc_row(section, "Marlin int4 GEMMs")[1:] == [per_step(r, {"marlin_gemm"}) for r in columns]
    assert doc_row(section, "dense GEMMs (the bf16 head, in_proj_a/b, the MTP layer)")[1:] == [
        per_step(r, {"dense_gemm"}) for r in columns
    ]
    assert doc_row(section, "**GPU busy**")[1:] == [f"**{per_step(r)}**" for r in columns]
    gigabytes = [r["decode"]["weights_bytes_per_step"] // 10**7 for r in (plain, plugins, k4, pruned)]
    assert gigabytes == [328, 631, 933, 306]  # the docs' 3.29 -> 6.31 -> 9.34 GB and 3.06 GB, truncated

    assert doc_row(section, "AWQ + int4 head, vocab 131,072")[:1] == [medians(pruned_plain, "repeated")]
    assert doc_row(section, "AWQ + int4 head, vocab 131,072 + MTP K=2") == [
        *(medians(pruned, s) for s in SETS),
        " / ".join(f"{mean_itl(pruned, s):.2f}" for s in SETS) + " ms",
    ]
    log = (folder / "logs" / "machine21-awq-broad-vocab131k-mtp2-first.log").read_text()
    assert "Sharing target model lm_head weights with the draft model" in log


# ---------- Marlin's reduction modes (gpu_proof/marlin_bench.py, serving/marlin_reduce.py) ----------


def qwen35_int4_header(head_vocab: int | None = None) -> dict:
    """compressed-tensors names and shapes of an int4 g32 Qwen3.5-4B (the broad recipe's modules; an int4 head of
    `head_vocab` rows), with each tensor's bytes."""
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from build_checkpoint import QWEN35_4B_DIMS as dims

    hidden, inter = dims["hidden_size"], dims["intermediate_size"]
    key_dim = dims["linear_num_key_heads"] * dims["linear_key_head_dim"]
    value_dim = dims["linear_num_value_heads"] * dims["linear_value_head_dim"]
    heads, kv = dims["num_attention_heads"] * dims["head_dim"], dims["num_key_value_heads"] * dims["head_dim"]
    modules = {}
    for i, kind in enumerate(dims["layer_types"]):
        prefix = f"model.language_model.layers.{i}"
        modules |= {f"{prefix}.mlp.gate_proj": (inter, hidden), f"{prefix}.mlp.up_proj": (inter, hidden)}
        modules[f"{prefix}.mlp.down_proj"] = (hidden, inter)
        if kind == "linear_attention":
            modules[f"{prefix}.linear_attn.in_proj_qkv"] = (2 * key_dim + value_dim, hidden)
            modules[f"{prefix}.linear_attn.in_proj_z"] = (value_dim, hidden)
            modules[f"{prefix}.linear_attn.out_proj"] = (hidden, value_dim)
        else:  # q_proj carries the output gate: twice the heads
            modules[f"{prefix}.self_attn.q_proj"] = (2 * heads, hidden)
            modules |= {f"{prefix}.self_attn.k_proj": (kv, hidden), f"{prefix}.self_attn.v_proj": (kv, hidden)}
            modules[f"{prefix}.self_attn.o_proj"] = (hidden, heads)
    modules["mtp.layers.0.mlp.down_proj"] = (hidden, inter)  # not part of a plain step
    if head_vocab:
        modules["lm_head"] = (head_vocab, hidden)
    header = {}
    for name, (n, k) in modules.items():
        header[f"{name}.weight_packed"] = {"shape": [n, k // 8], "bytes": n * k // 2}
        header[f"{name}.weight_scale"] = {"shape": [n, k // 32], "bytes": n * k // 32 * 2}
    return header


def test_marlin_bench_fuses_the_checkpoints_gemms_as_vllm_does():
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from marlin_bench import decode_gemms

    gemms = {g["module"]: g for g in decode_gemms(qwen35_int4_header(head_vocab=131072))}
    shapes = {name: (g["k"], g["n"], g["layers"], g["group_size"]) for name, g in gemms.items()}
    assert shapes == {
        "mlp.gate_up_proj": (2560, 18432, 32, 32),
        "mlp.down_proj": (9216, 2560, 32, 32),
        "linear_attn.in_proj_qkvz": (2560, 12288, 24, 32),
        "linear_attn.out_proj": (4096, 2560, 24, 32),
        "self_attn.qkv_proj": (2560, 10240, 8, 32),
        "self_attn.o_proj": (4096, 2560, 8, 32),
        "lm_head": (2560, 131072, 1, 32),
    }
    # by hand: 3,565,158,400 decoder weights at 4 bits plus a bf16 scale per 32 (the record's decoder part is this
    # plus 9.8 MB of 16-bit tensors: norms, conv1d, in_proj_a/b); the head's 131,072 x 2,560 the same way
    decoder = sum(g["bytes"] for name, g in gemms.items() if name != "lm_head")
    assert decoder == 3_565_158_400 // 2 + 3_565_158_400 // 32 * 2 == 2_005_401_600
    assert gemms["lm_head"]["bytes"] == 188_743_680
    # the H100's quantized checkpoint (its safetensors parts): the head adds its 16-byte weight_shape tensor
    served = json.loads((ROOT / "results/gpu-proof/h100-mtp/variant-awq-broad-vocab131k-plain.json").read_text())
    assert 9_000_000 < served["weights"]["decoder"] - decoder < 10_000_000
    assert served["weights"]["lm_head"] - gemms["lm_head"]["bytes"] == 16


def test_marlin_bench_refuses_modules_that_cannot_fuse_and_compares_modes_with_vllms_call():
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from marlin_bench import decode_gemms, summarize

    header = qwen35_int4_header()
    header["model.language_model.layers.0.mlp.up_proj.weight_scale"]["shape"] = [9216, 2560 // 128]  # group 128
    with pytest.raises(ValueError, match="up_proj.*do not fuse with mlp.gate_up_proj"):
        decode_gemms(header)
    gemms = [{"module": "mlp.down_proj", "bytes": 2_000_000_000}]
    timings = {
        "marlin": {1: {"step_ms": 2.0, "by_gemm_us": {"mlp.down_proj": 20.0}}},
        "marlin-atomic": {1: {"step_ms": 1.5, "by_gemm_us": {"mlp.down_proj": 12.345}}},
    }
    summary = summarize(gemms, timings)
    assert summary["marlin"]["1"]["int4_gbps"] == 1000.0 and summary["marlin"]["1"]["against_marlin"] == 1.0
    assert summary["marlin-atomic"]["1"] == {
        "step_ms": 1.5,
        "int4_gbps": 1333.3,
        "against_marlin": 0.75,
        "by_gemm_us": {"mlp.down_proj": 12.35},
    }


def test_driver_serves_each_marlin_mode_on_its_own_compiled_graphs(tmp_path):
    """The eighteenth lease: vLLM's mode bakes from an empty cache; atomics and bf16 partial sums start from its kernel
    caches only (the mode is traced into the graphs), each with the plugin's switch in its server's environment."""
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    import driver

    assert {s for s in driver.STEPS if "vocab131k-plain-" in s} >= {
        "marlinbench-vocab131k-plain-vllm",
        "serve-vocab131k-plain-vllm",
        "serve-vocab131k-plain-atomic",
        "serve-vocab131k-plain-bf16",
    }
    d = fake_driver(tmp_path)
    quantized = tmp_path / "quant" / "awq-broad-head4-vocab131k" / "model"
    shutil.copytree(d.model_dir, quantized)
    (quantized / "config.json").write_text("{}")
    d.run_steps(["serve-vocab131k-plain-vllm", "serve-vocab131k-plain-atomic"])
    vllm, atomic = (
        json.loads((tmp_path / "results" / f"variant-vocab131k-plain-{mode}.json").read_text())
        for mode in ("vllm", "atomic")
    )
    assert vllm["status"] == atomic["status"] == "ok"
    assert vllm["cold_start"]["first_start_cache"] == "empty" and "cache_files" in vllm["cold_start"]
    assert atomic["cold_start"]["first_start_cache"] == "seeded" and "cache_files" not in atomic["cold_start"]
    assert vllm["serve_env"] == {"SERVING_MARLIN_REDUCE": "vllm"}
    assert atomic["serve_env"] == {"SERVING_MARLIN_REDUCE": "atomic"}
    assert set(atomic["profile"]["sets"]) == {"repeated", "fresh"} and atomic["probe"]["fresh"]


INT4_LAYOUT_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/gpu_proof")
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from experiments import int4_gemv

torch.manual_seed(0)
values = torch.randint(-8, 8, (24, 512), dtype=torch.int8)
packed = pack_to_int32(values, 4)  # what llmcompressor writes as weight_packed
scales = torch.rand(24, 512 // 32) + 0.5
print(json.dumps({
    "shape": list(packed.shape),
    "unpacked": torch.equal(int4_gemv.unpack_int4(packed), values.int()),
    "dequantized": torch.equal(int4_gemv.dequantize(packed, scales), values.float() * scales.repeat_interleave(32, 1)),
}))
"""


@pytest.mark.e2e
def test_the_tried_int4_gemv_reads_the_layout_compressed_tensors_writes():
    """The packing gpu_proof/experiments/int4_gemv.py unpacks (eight consecutive k to an int32 at 4-bit steps, value
    + 8) is the one compressed-tensors 0.19 writes; its dequantize() is the reference its kernel was checked with."""
    result = subprocess.run(
        [str(COMPRESS_PY), "-c", INT4_LAYOUT_CHECK, str(ROOT)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"shape": [24, 64], "unpacked": True, "dequantized": True}
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from experiments.int4_gemv import CONFIGS, configs_for

    # no tail loop: a config runs only where its k step (8 a word) divides K (2,560 = 5 x 512, not 1,024s)
    assert {8 * CONFIGS[i][1] for i in configs_for(2560)} == {256, 512}
    assert {8 * CONFIGS[i][1] for i in configs_for(9216)} == {256, 512, 1024}


def test_the_marlin_section_is_its_records():
    """machine22-24: the bench's table and the served table of docs/gpu-proof.md recomputed from the records; no
    reduction mode changes a step's GPU work; the tried GEMV slower than Marlin on both of its hosts."""
    from serving.marlin_reduce import ENV as MARLIN_REDUCE

    marlin, gemv = lease_records(RESULTS.parent / "h100-marlin"), lease_records(RESULTS.parent / "h100-int4-gemv")
    assert_lease(marlin, "machine22")
    assert_lease(gemv, "machine23", "machine24", "machine25")
    section = "# Marlin, the largest item of a step"
    bench = marlin["marlinbench-vocab131k-plain-vllm"]
    assert bench["int4_bytes"] == sum(g["bytes"] for g in bench["gemms"]) == 2_194_145_280
    assert sum(g["layers"] for g in bench["gemms"]) == 129
    for label, mode in (
        ("Marlin as vLLM calls it (fp32 partial sums, in turn)", "marlin"),
        ("Marlin, bf16 partial sums", "marlin-bf16-reduce"),
        ("Marlin, atomic partial sums", "marlin-atomic"),
        ("vLLM's Triton W4A16 (its ROCm kernel)", "triton-w4a16"),
        ("dense bf16 (cuBLAS), four times the bytes", "bf16"),
    ):
        one, three = bench["modes"][mode]["1"], bench["modes"][mode]["3"]
        modules = ("mlp.gate_up_proj", "mlp.down_proj", "linear_attn.out_proj", "lm_head")
        per_gemm = [one["by_gemm_us"][m] for m in modules]
        assert doc_row(section, label) == [
            f"{one['step_ms']:.3f}",
            f"{three['step_ms']:.3f}",
            f"{one['int4_gbps']:.0f}",
            *(f"{us:.1f}" for us in per_gemm),
        ], label
    steps = [bench["modes"][m][n]["step_ms"] for m in ("marlin", "marlin-bf16-reduce", "marlin-atomic") for n in "13"]
    assert max(steps) - min(steps) < 0.03  # no reduction mode moves the step
    assert bench["relative_error"]["marlin-atomic"] == bench["relative_error"]["marlin"]
    forms = [gemv[f"marlinbench-{name}"] for name in ("vocab131k-plain-vllm", "second-form", "third-form")]
    assert [f"{b['modes']['int4-gemv']['1']['step_ms']:.2f}" for b in forms] == ["4.37", "3.07", "3.50"]
    assert [b["machine"] for b in forms] == ["machine23", "machine24", "machine25"]
    for b in forms:
        assert b["modes"]["int4-gemv"]["1"]["step_ms"] > 1.7 * b["modes"]["marlin"]["1"]["step_ms"]

    plain = marlin["variant-vocab131k-plain-vllm"]
    for label, record in (
        ("vLLM's mode (fp32 partial sums in turn)", plain),
        ("atomics", marlin["variant-vocab131k-plain-atomic"]),
        ("bf16 partial sums", marlin["variant-vocab131k-plain-bf16"]),
    ):
        assert record["serve_env"][MARLIN_REDUCE] == record["variant"].rsplit("-", 1)[1]
        itl_cells(section, label, record, plain)
        assert doc_row(section, label)[5:] == [per_step(record), per_step(record, {"marlin_gemm"})], label
    other_host = gemv["variant-vocab131k-plain-vllm"]
    cells = doc_row(section, "vLLM's mode, machine23")
    assert cells[:3] == [medians(other_host, s) for s in SETS] and cells[5:] == [per_step(other_host), "1.895"]


RUNTIME_EAGER_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaLaunchKernelExC")


def per_set_cell(record, field: str, digits: int) -> str:
    """A profile-table cell: a decode step's `field` on the repeated / fresh set, in ms."""
    sets = record["profile"]["sets"]
    return " / ".join(f"{sets[s]['breakdown']['per_step'][field]:.{digits}f}" for s in ("repeated", "fresh")) + " ms"


def step_cells(record) -> list[str]:
    """A profile-table row: GPU busy and step window (repeated / fresh), then graph launches, eager kernel launches
    and host-device copies a step (the fresh trace's runtime calls over its steps)."""
    fresh = record["profile"]["sets"]["fresh"]["breakdown"]
    eager = sum(row["count"] for row in fresh["top_runtime"] if row["name"] in RUNTIME_EAGER_LAUNCHES)
    return [
        per_set_cell(record, "busy_ms", 3),
        per_set_cell(record, "window_ms", 2),
        *(
            f"{count / fresh['steps']:.1f}"
            for count in (runtime_calls(record, "cudaGraphLaunch"), eager, runtime_calls(record, "cudaMemcpyAsync"))
        ),
    ]


def test_the_second_runner_section_is_its_records():
    """machine26-27: both tables of runs and the profile table recomputed from the records; the runner reached vLLM
    (its log), an MTP token cheaper on V2 with the same GPU work, the plain token not; the lossless record as stated."""
    runners, lossless = (
        lease_records(RESULTS.parent / "h100-runner2"),
        lease_records(RESULTS.parent / "h100-runner2-lossless"),
    )
    assert_lease(runners, "machine26")
    assert_lease(lossless, "machine27")
    section = "# The second model runner"
    rows = {
        "int4 head, vocab 131,072, runner V1": "plain-runner1",
        "int4 head, vocab 131,072, runner V2": "plain-runner2",
        "+ MTP K=2, runner V1": "mtp2-runner1",
        "+ MTP K=2, runner V2": "mtp2-runner2",
    }
    plain = runners["variant-vocab131k-plain-runner1"]
    for label, name in rows.items():
        record = runners[f"variant-vocab131k-{name}"]
        itl_cells(section, label, record, plain)
        runner = name[-1]
        v2_log = (
            "Using V2 Model Runner"
            in (RESULTS.parent / "h100-runner2" / "logs" / f"machine26-vocab131k-{name}-first.log").read_text()
        )
        assert v2_log == (runner == "2"), name
    profile_labels = {
        "plain, V1": "plain-runner1",
        "plain, V2": "plain-runner2",
        "MTP K=2, V1": "mtp2-runner1",
        "MTP K=2, V2": "mtp2-runner2",
    }
    for label, name in profile_labels.items():
        assert doc_row(section, label) == step_cells(runners[f"variant-vocab131k-{name}"]), label
    v1, v2 = runners["variant-vocab131k-mtp2-runner1"], runners["variant-vocab131k-mtp2-runner2"]
    assert all(mean_itl(v2, s) < 0.8 * mean_itl(v1, s) for s in SETS)  # a third off, every set
    busy = [r["profile"]["sets"]["repeated"]["breakdown"]["per_step"]["busy_ms"] for r in (v1, v2)]
    assert abs(busy[0] - busy[1]) < 0.05  # the same GPU work: the gain is host time
    drops = [
        1 - b["median_ms"] / a["median_ms"]
        for s in SETS
        for a, b in zip(set_categories(v1, s), set_categories(v2, s), strict=True)
    ]
    assert f"fall by {round(100 * min(drops))}-{round(100 * max(drops))} %" in GPU_PROOF_DOC.read_text()

    bf16, mtp = lossless["variant-bf16-reference"], lossless["variant-bf16-mtp2-runner2"]
    assert mtp["serve_settings"]["model_runner"] == "v2" and "VLLM_USE_V2_MODEL_RUNNER" not in mtp["serve_env"]
    itl_cells(section, "bf16", bf16, bf16)
    itl_cells(section, "bf16 + MTP K=2, runner V2", mtp, bf16)
    assert lossless_pairs_passed(lossless) == {"bf16-mtp2-runner2": 7}


def kernel_ms_a_step(record, set_name, prefix) -> float:
    """A profile's kernels whose name starts with `prefix` (its top kernels), in ms a decode step."""
    breakdown = record["profile"]["sets"][set_name]["breakdown"]
    return sum(k["total_ms"] for k in breakdown["top_kernels"] if k["name"].startswith(prefix)) / breakdown["steps"]


# PyTorch's fill kernel, as GemLite's split-K zeroes each GEMV's output before adding into it
ZERO_FILL = "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>"


def test_the_kernels_section_is_its_records():
    """machine28: the bench table, the served table and the profile table recomputed from the records; no kernel
    beats Marlin over the step, the per-shape mix's bound as stated, and GemLite reached vLLM (its GEMVs in the
    trace, no Marlin kernel)."""
    found = lease_records(RESULTS.parent / "h100-kernels")
    assert_lease(found, "machine28")
    section = "# Two more one-token int4 kernels"
    bench = found["marlinbench-kernels"]
    layers = {g["module"]: g["layers"] for g in bench["gemms"]}
    columns = ("mlp.gate_up_proj", "linear_attn.in_proj_qkvz", "mlp.down_proj", "linear_attn.out_proj")
    columns += ("self_attn.o_proj", "lm_head")
    labels = {"Marlin, as vLLM calls it": "marlin", "tinygemm": "tinygemm", "GemLite": "gemlite"}
    for label, mode in {**labels, "dense bf16 (cuBLAS)": "bf16"}.items():
        one, three = bench["modes"][mode]["1"], bench["modes"][mode]["3"]
        assert doc_row(section, label) == [
            f"{one['step_ms']:.3f}",
            f"{three['step_ms']:.3f}",
            f"{one['int4_gbps']:.0f}",
            *(f"{one['by_gemm_us'][module]:.1f}" for module in columns),
        ], label
    steps = {mode: bench["modes"][mode]["1"]["step_ms"] for mode in labels.values()}
    assert all(step >= 0.99 * steps["marlin"] for step in steps.values())  # none beats Marlin (GemLite ties it)
    by_gemm = {mode: bench["modes"][mode]["1"]["by_gemm_us"] for mode in labels.values()}
    best = sum(min(by_gemm[mode][module] for mode in by_gemm) * n for module, n in layers.items()) / 1e3
    marlin = sum(by_gemm["marlin"][module] * n for module, n in layers.items()) / 1e3
    text = GPU_PROOF_DOC.read_text()
    assert f"adds up to {best:.3f} ms\n  against Marlin's {marlin:.3f} ms" in text
    assert f"save at most {marlin - best:.2f} ms a step" in text

    served = {"Marlin": found["variant-vocab131k-plain-marlin"], "GemLite": found["variant-vocab131k-plain-gemlite"]}
    for name, record in served.items():
        itl_cells(section, f"int4 head, vocab 131,072, {name}", record, served["Marlin"])
    assert served["GemLite"]["serve_env"]["VLLM_GEMLITE_ENABLE"] == "1"
    assert served["Marlin"]["serve_env"]["VLLM_GEMLITE_ENABLE"] == "0"
    int4 = {
        "Marlin": f"{kernel_ms_a_step(served['Marlin'], 'fresh', 'void marlin::'):.3f} ms",
        "GemLite": f"{kernel_ms_a_step(served['GemLite'], 'fresh', 'gemv_INT_revsplitK'):.3f} + "
        f"{kernel_ms_a_step(served['GemLite'], 'fresh', ZERO_FILL):.3f} ms",
    }
    assert kernel_ms_a_step(served["GemLite"], "fresh", "void marlin::") == 0  # no Marlin kernel left
    # the device's breakdown (written before inductor-fused kernels were kept out of GEMM families) over Marlin's own
    filed = served["Marlin"]["profile"]["sets"]["fresh"]["breakdown"]["families"]["marlin_gemm"]["per_step_ms"]
    overcount = filed - kernel_ms_a_step(served["Marlin"], "fresh", "void marlin::")
    assert f"counted it as the GEMM ({overcount:.2f} ms a step" in text
    for name, record in served.items():
        launch = [runtime_row(record, "cudaGraphLaunch", s) for s in ("repeated", "fresh")]
        assert doc_row(section, f"step on {name}") == [
            per_set_cell(record, "busy_ms", 3),
            int4[name],
            f"{record['profile']['sets']['fresh']['breakdown']['per_step']['kernels']:.1f}",
            per_set_cell(record, "window_ms", 2),
            " / ".join(f"{r['total_ms'] / r['count']:.2f}" for r in launch) + " ms",
        ], name


# ---- py-spy on the engine core (run_spy, gpu_proof/spy_breakdown.py) ----

# as py-spy 0.4 writes them on the H100 host: methods by their class, files by their path under site-packages
LOOP = (
    "<module> (<string>:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1364);"
    "EngineCore.step_with_batch_queue (vllm/v1/engine/core.py"
)
RUNNER = "GPUModelRunner.{} (vllm/v1/worker/gpu_model_runner.py:{})"
SPY_RAW = "\n".join(
    [
        f"thread (2388): MainThread;{LOOP}:645);Scheduler.schedule (vllm/v1/core/sched/scheduler.py:300) 30",
        f"thread (2388): MainThread;{LOOP}:647);{RUNNER.format('execute_model', 4111)};"
        f"{RUNNER.format('_update_states', 1169)} 50",
        f"thread (2388): MainThread;{LOOP}:647);{RUNNER.format('execute_model', 4200)} 20",
        # the end of execute_model waits for the previous step's accepted counts
        f"thread (2388): MainThread;{LOOP}:647);{RUNNER.format('execute_model', 4477)};"
        f"{RUNNER.format('_get_valid_sampled_token_count', 4922)} 40",
        f"thread (2388): MainThread;{LOOP}:650);AsyncGPUModelRunnerOutput.get_output (gpu_model_runner.py:300);"
        "Event.synchronize (torch/cuda/streams.py:254) 10",
        # recursion: a function twice on one stack counts once inclusive
        f"thread (2388): MainThread;{LOOP}:660);{RUNNER.format('sample_tokens', 4497)};"
        f"{RUNNER.format('sample_tokens', 4510)} 100",
        "thread (2960): Thread-2 (process_output_sockets);"
        "EngineCoreProc.process_output_sockets (vllm/v1/engine/core.py:1500) 60",
    ]
)
SAMPLE = "GPUModelRunner.sample_tokens (vllm/v1/worker/gpu_model_runner.py)"
EXECUTE = "GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py)"
SCHEDULE = "Scheduler.schedule (vllm/v1/core/sched/scheduler.py)"


def test_spy_breakdown_reads_py_spys_raw_stacks_per_function_and_per_step():
    from gpu_proof.spy_breakdown import breakdown, parse

    result = breakdown(SPY_RAW, rate_hz=100, step_ms=4.0, anchor="step_with_batch_queue")
    assert result["main_thread"] == "MainThread (2388)" and result["main_samples"] == 250
    assert result["gpu_wait"] == {"samples": 50, "share": 0.2, "ms_per_step": 0.8}  # both kinds of wait
    assert result["threads"]["Thread-2 (process_output_sockets) (2960)"] == {"samples": 60, "seconds": 0.6}
    inclusive = {row["function"]: row for row in result["inclusive"]}
    assert inclusive["EngineCore.step_with_batch_queue (vllm/v1/engine/core.py)"]["share"] == 1.0
    assert inclusive[SAMPLE] == {"function": SAMPLE, "samples": 100, "share": 0.4, "ms_per_step": 1.6}
    assert inclusive[EXECUTE]["samples"] == 110  # three lines, one function
    own = {row["function"]: row["samples"] for row in result["self"]}
    assert own == {
        SAMPLE: 100,
        "GPUModelRunner._update_states (vllm/v1/worker/gpu_model_runner.py)": 50,
        "GPUModelRunner._get_valid_sampled_token_count (vllm/v1/worker/gpu_model_runner.py)": 40,
        SCHEDULE: 30,
        EXECUTE: 20,
        "Event.synchronize (torch/cuda/streams.py)": 10,
    }
    callees = {row["function"]: row["ms_per_step"] for row in result["anchor"]["callees"]}
    assert callees == {
        EXECUTE: 1.76,
        SAMPLE: 1.6,
        SCHEDULE: 0.48,
        "AsyncGPUModelRunnerOutput.get_output (gpu_model_runner.py)": 0.16,
    }
    with pytest.raises(ValueError, match="not py-spy raw output"):
        parse("MainThread;f (a.py:1) 3")
    with pytest.raises(ValueError, match="no thread runs"):
        breakdown(SPY_RAW.splitlines()[-1], rate_hz=100)
    with pytest.raises(ValueError, match="no samples"):
        parse("\n")


FAKE_PY_SPY = """
import sys, time
args = sys.argv[1:]
pid, out = args[args.index("--pid") + 1], args[args.index("-o") + 1]
cmdline = open(f"/proc/{pid}/cmdline").read()
assert "fake_server.py" in cmdline, cmdline
time.sleep(float(args[args.index("--duration") + 1]))
busy = 100 if "--idle" in args else 40
open(out, "w").write(
    f"thread (1): MainThread;EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1364);"
    f"EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:647);sample_tokens (gpu_model_runner.py:4497) {busy}\\n"
    "thread (1): MainThread;EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1364);"
    "EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:645);schedule (scheduler.py:300) 20\\n"
)
"""


def spied_fake_driver(tmp_path):
    """fake_driver with AWQ broad's quantized checkpoint (a copy), a fake py-spy, short windows and a short probe."""
    d = fake_driver(tmp_path)
    quantized = tmp_path / "quant" / "awq-w4a16-g32-broad" / "model"
    shutil.copytree(d.model_dir, quantized)
    (quantized / "config.json").write_text("{}")
    fake_spy = tmp_path / "py_spy.py"
    fake_spy.write_text(FAKE_PY_SPY)
    d.spy_cmd, d.engine_core_title = [sys.executable, str(fake_spy)], "fake_server.py"
    d.spy.update(window_s=1, lead_s=0.2, output_tokens=1000)  # py-spy's --duration takes whole seconds
    d.serve_env = {"FAKE_TOKEN_DELAY_S": "0.003"}
    probe_settings = d.probe_settings()  # a short probe: the slow tokens are for the spied request
    d.probe_settings = lambda: dict(probe_settings, categories=[dict(probe_settings["categories"][0], output_tokens=4)])
    return d


def test_the_h200_lease_profiles_the_plain_step_and_restarts_k2_from_its_own_baked_cache(tmp_path):
    """The twenty-sixth lease's chain: the plain start is spied and profiled, K=2 bakes its cache from the plain
    start's, and one more K=2 start runs on that baked cache (the picks its first start made)."""
    from gpu_proof.driver import VARIANTS, differing_picks

    d = spied_fake_driver(tmp_path)
    steps = ["awq-broad-spied-profile", "awq-broad-ngramgpu2-baked", "awq-broad-ngramgpu2-rebaked"]
    d.run_steps([f"serve-{step}" for step in steps])
    plain, baked, rebaked = (json.loads((tmp_path / "results" / f"variant-{step}.json").read_text()) for step in steps)
    assert all(record["status"] == "ok" for record in (plain, baked, rebaked))
    assert set(plain["profile"]["sets"]) == {"repeated", "fresh"} and plain["spy"]["wall"]["main_samples"] > 0
    assert baked["speculative"] == rebaked["speculative"] and baked["speculative"]["k"] == 2
    assert baked["cold_start"]["first_start_cache"] == rebaked["cold_start"]["first_start_cache"] == "seeded"
    assert (tmp_path / "cache" / "awq-broad-ngramgpu2-baked.tar").exists()  # the cache the second start began on
    assert VARIANTS["awq-broad-ngramgpu2-baked"]["first"] == "from:awq-broad-spied-profile"
    assert VARIANTS["awq-broad-ngramgpu2-rebaked"]["first"] == "from:awq-broad-ngramgpu2-baked"
    assert differing_picks(baked["kernel_picks"], rebaked["kernel_picks"])["triton"] == {"shared": 1, "differ": []}


def test_driver_spies_on_the_engine_core_during_one_long_request(tmp_path):
    """A `spy` variant: after the probe, py-spy samples the server's engine core (found by its title in the server's
    session) in two windows of one long request; the record holds both breakdowns with the request's time a step, and
    the raw stacks are kept gzipped. A request shorter than the windows fails the step instead of recording them."""
    d = spied_fake_driver(tmp_path)
    d.run_steps(["serve-awq-broad-spied"])
    record = json.loads((tmp_path / "results" / "variant-awq-broad-spied.json").read_text())
    assert record["status"] == "ok", record
    spy = record["spy"]
    assert spy["request"]["output_tokens"] == 1000 and spy["step_ms"] == pytest.approx(spy["request"]["itl_ms"])
    assert spy["wall"]["main_samples"] == 120 and spy["cpu"]["main_samples"] == 60
    callees = {row["function"]: row["share"] for row in spy["wall"]["anchor"]["callees"]}
    assert callees == {"sample_tokens (gpu_model_runner.py)": 0.8333, "schedule (scheduler.py)": 0.1667}
    assert sorted(p.name for p in (tmp_path / "results" / "spy").iterdir()) == [
        "awq-broad-spied-cpu.txt.gz",
        "awq-broad-spied-wall.txt.gz",
    ]
    d.spy.update(output_tokens=10)
    d.run_steps(["serve-awq-broad-ngramgpu4-spied"])  # the bake above left the cache it starts from
    record = json.loads((tmp_path / "results" / "variant-awq-broad-ngramgpu4-spied.json").read_text())
    assert record["status"] == "ok" and "ended before py-spy's windows" in record["spy"]["error"]
    assert not list((tmp_path / "results" / "spy").glob("awq-broad-ngramgpu4-*")), "stacks past the request kept"


def test_the_spied_request_is_sized_to_outlast_py_spys_windows():
    """machine30: AWQ broad's spied request, a fixed 6,144 tokens at 3.35 ms (20.6 s), ended inside py-spy's second
    window, each py-spy run taking 3-5 s beyond its --duration. Sized from the variant's fastest probed ITL, the
    request lasts the lead and both windows with py-spy's start, longer than that failed one; a fixed count is
    kept as given, and the context the prompt leaves caps the count."""
    from gpu_proof.driver import SHORT_SPY_REQUEST, SPY, spy_output_tokens
    from gpu_proof.spy_breakdown import WINDOWS

    plain = lease_records(RESULTS.parent / "h100-silent-k")["variant-awq-broad-spied"]
    assert plain["spy"]["error"].startswith(f"{SHORT_SPY_REQUEST} (6144 tokens in 20586 ms)")
    fastest = min(c["itl_median_ms"] for s in SETS for c in set_categories(plain, s))
    tokens = spy_output_tokens(SPY, plain["probe"], plain["serve_settings"]["max_model_len"])
    lasts_s = tokens * fastest / 1000
    assert lasts_s >= SPY["lead_s"] + len(WINDOWS) * (SPY["window_s"] + SPY["pyspy_start_s"]) > 20.586 + 3
    assert spy_output_tokens(dict(SPY, output_tokens=1000), plain["probe"], 13568) == 1000
    assert spy_output_tokens(SPY, plain["probe"], 4096) == 4096 - 2 * SPY["prompt_tokens"]


def test_collect_keeps_the_raw_stacks_and_fills_a_spied_variants_missing_breakdowns(tmp_path):
    """machine29's driver kept py-spy's stacks but failed to break them down (its parser missed py-spy's class-
    qualified names): collect.py gzips the stacks into OUT/spy/ and fills the breakdowns, the step time from the
    variant's varied set when the spied request's own was not recorded."""
    import io
    import tarfile

    record = {
        "kind": "variant",
        "status": "ok",
        "variant": "x-spied",
        "spy": {"error": "the old parser failed"},
        "probe": {"varied": {"categories": [{"itl_median_ms": 3.0}, {"itl_median_ms": 5.0}]}},
        "decode": {},
    }
    tarball = tmp_path / "results.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        for name, text in (
            ("results/variant-x-spied.json", json.dumps(record)),
            ("results/spy/x-spied-wall.txt", SPY_RAW),
            ("results/spy/x-spied-cpu.txt", SPY_RAW),
            ("results/logs/x-spied-first.log", "log"),
        ):
            data = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    out = tmp_path / "lease"
    subprocess.run([sys.executable, str(ROOT / "gpu_proof" / "collect.py"), str(out), f"m9={tarball}"], check=True)
    spy = json.loads((out / "variant-x-spied.json").read_text())["spy"]
    assert spy["error"] == "the old parser failed" and "collect.py" in spy["filled_by"]
    assert spy["step_ms"] == 4.0 and "varied set" in spy["step_ms_source"]
    assert spy["wall"]["gpu_wait"]["ms_per_step"] == 0.8 and spy["cpu"]["main_samples"] == 250
    assert spy["raw"] == {"wall": "spy/x-spied-wall.txt.gz", "cpu": "spy/x-spied-cpu.txt.gz"}
    assert sorted(p.name for p in (out / "spy").iterdir()) == ["x-spied-cpu.txt.gz", "x-spied-wall.txt.gz"]
    assert (out / "logs" / "m9-x-spied-first.log").read_text() == "log"


def named_ms(rows: list[dict], name: str) -> float:
    """ms a step of the py-spy rows of function `name` (bare or qualified, as spy_breakdown matches names)."""
    from gpu_proof.spy_breakdown import is_named

    return sum(row["ms_per_step"] for row in rows if is_named(row["function"], name))


def engine_step_part(window: dict, name: str) -> float:
    """ms a step of the engine step's direct callee `name`."""
    return named_ms(window["anchor"]["callees"], name)


def host_time_cells(spy: dict) -> list[str]:
    """A py-spy docs row's cells, ms a step: the step, GPU waits, host work, the engine step's callees
    (execute_model, sample_tokens, schedule + update_from_output, the output wait), on-CPU / wall samples."""
    wall = spy["wall"]
    wait = wall["gpu_wait"]["ms_per_step"]
    return [
        f"{spy['step_ms']:.2f}",
        f"{wait:.2f}",
        f"{spy['step_ms'] - wait:.2f}",
        *(f"{engine_step_part(wall, part):.2f}" for part in ("execute_model", "sample_tokens")),
        f"{engine_step_part(wall, 'schedule') + engine_step_part(wall, 'update_from_output'):.2f}",
        f"{engine_step_part(wall, 'AsyncOutputFuture.result'):.2f}",
        f"{spy['cpu']['main_samples'] / wall['main_samples']:.2f}",
    ]


def assert_spied_rows(folder: Path, section: str, spies: dict) -> None:
    """Each docs row `label` of `section`'s host-time table is its record's py-spy breakdown, recomputed from the kept
    raw stacks at the step time of the spied request's own ITL (the driver's since machine31)."""
    from gpu_proof.spy_breakdown import WINDOWS, breakdown, read_raw

    for label, record in spies.items():
        spy = record["spy"]
        assert spy["step_ms"] == round(spy["request"]["itl_ms"], 3) and "error" not in spy, label
        for window in WINDOWS:
            raw, step_ms = read_raw(folder / spy["raw"][window]), spy[window]["step_ms"]
            assert round(step_ms, 3) == spy["step_ms"], (label, window)
            assert spy[window] == breakdown(raw, 1000, step_ms, anchor="step_with_batch_queue"), (label, window)
        assert doc_row(section, label) == host_time_cells(spy), label


def test_the_spy_section_is_its_records():
    """machine29: the served table and the host-time table recomputed from the records and the kept raw stacks; the
    silent step waits on the GPU more than the plain one, MTP on V2 hardly at all; each filled spy says how."""
    from gpu_proof.spy_breakdown import WINDOWS, breakdown, read_raw

    folder = RESULTS.parent / "h100-spy"
    found = lease_records(folder)
    assert_lease(found, "machine29")
    section = "# Where the engine core's host time goes"
    rows = {
        "AWQ broad": "awq-broad-spied",
        "AWQ + ngram_gpu K=4, padded, graphs, every plugin": "awq-broad-ngramgpu4-spied",
        "AWQ + MTP K=2, runner V2": "awq-broad-mtp2-runner2-spied",
    }
    plain = found["variant-awq-broad-spied"]
    for label, name in rows.items():
        itl_cells(section, label, found[f"variant-{name}"], plain)
    host_labels = ("plain step, AWQ broad", "ngram_gpu K=4, padded, every plugin", "MTP K=2, runner V2")
    host_rows = dict(zip(host_labels, rows.values(), strict=True))
    for label, name in host_rows.items():
        record = found[f"variant-{name}"]
        assert_plugins_on(record)
        spy = record["spy"]
        assert spy["step_ms"] == round(mean_itl(record, "varied"), 3) and "varied set" in spy["step_ms_source"]
        for window in WINDOWS:  # the breakdowns are what the kept stacks say
            raw = read_raw(folder / spy["raw"][window])
            assert spy[window] == breakdown(raw, 1000, spy["step_ms"], anchor="step_with_batch_queue"), window
        assert doc_row(section, label) == host_time_cells(spy), label
    waits = {name: found[f"variant-{name}"]["spy"]["wall"]["gpu_wait"]["share"] for name in rows.values()}
    assert waits["awq-broad-ngramgpu4-spied"] > waits["awq-broad-spied"] > waits["awq-broad-mtp2-runner2-spied"]
    failures = [name for name in found if name.startswith("failed-")]
    assert all("--duration', '6.0'" in found[name]["error"] for name in failures if name.endswith("broad-spied"))


def test_the_silent_k_section_is_its_records():
    """machine30: the served table and the host-time table recomputed from the records and the kept raw stacks. At
    K=2 and K=1 the silent step waits on the GPU less than K=4 did on machine29 and its host work exceeds machine29's
    plain step's: host-bound, so a shorter verify does not make it cheaper; the parts the docs name are the records'."""
    from gpu_proof.spy_breakdown import WINDOWS, breakdown, read_raw

    folder = RESULTS.parent / "h100-silent-k"
    found = lease_records(folder)
    assert_lease(found, "machine30")
    section = "# A shorter verify for the silent copy drafter"
    plain = found["variant-awq-broad-spied"]
    rows = {
        "AWQ broad": plain,
        "AWQ + ngram_gpu K=2, padded, graphs, every plugin": found["variant-awq-broad-ngramgpu2-spied"],
        "AWQ + ngram_gpu K=1, padded, graphs, every plugin": found["variant-awq-broad-ngramgpu1-spied"],
    }
    for label, record in rows.items():
        itl_cells(section, label, record, plain)
        assert_plugins_on(record)
    earlier = lease_records(RESULTS.parent / "h100-spy")
    k4_wait = earlier["variant-awq-broad-ngramgpu4-spied"]["spy"]["wall"]["gpu_wait"]["ms_per_step"]
    plain_spy = earlier["variant-awq-broad-spied"]["spy"]
    plain_host = plain_spy["step_ms"] - plain_spy["wall"]["gpu_wait"]["ms_per_step"]
    for k in (2, 1):
        record = found[f"variant-awq-broad-ngramgpu{k}-spied"]
        spy = record["spy"]
        assert record["speculative"]["k"] == k and record["speculative"]["graph_drafter"]
        assert all(c["mean_acceptance_length"] == 1.0 for s in SETS for c in set_categories(record, s))
        assert spy["step_ms"] == spy["request"]["itl_ms"] and "request's ITL" in spy["step_ms_source"]
        for window in WINDOWS:  # the stacks' breakdowns, at the unrounded step time machine30's driver gave them
            raw, step_ms = read_raw(folder / spy["raw"][window]), spy[window]["step_ms"]
            assert round(step_ms, 3) == spy["step_ms"], window
            assert spy[window] == breakdown(raw, 1000, step_ms, anchor="step_with_batch_queue"), window
        assert doc_row(section, f"ngram_gpu K={k}, padded, every plugin") == host_time_cells(spy)
        wait = spy["wall"]["gpu_wait"]["ms_per_step"]
        assert wait < k4_wait / 2 and spy["step_ms"] - wait > plain_host + 0.9, k
    k2 = found["variant-awq-broad-ngramgpu2-spied"]["spy"]["wall"]
    named = {
        "`_prepare_input_ids` 0.26 ms": named_ms(k2["self"], "_prepare_input_ids"),
        "`_get_valid_sampled_token_count` 0.29 ms": named_ms(k2["self"], "_get_valid_sampled_token_count"),
        "`update_ngram_gpu_tensors_incremental` with its `_sync_num_tokens` 0.30 ms": named_ms(
            k2["self"], "update_ngram_gpu_tensors_incremental"
        )
        + named_ms(k2["self"], "_sync_num_tokens"),
        "the GDN spec metadata 0.18 ms": named_ms(k2["self"], "build_all_spec"),
        "the greedy rejection 0.16 ms": named_ms(k2["self"], "greedy_forward.<locals>.forward"),
    }
    doc = GPU_PROOF_DOC.read_text()
    text = " ".join(doc[doc.index(section) :].split())
    for phrase, ms in named.items():
        assert phrase in text and f"{ms:.2f} ms" in phrase, (phrase, ms)
    assert f"({named_ms(plain_spy['wall']['self'], '_prepare_input_ids'):.2f} plain)" in text
    first, *others = (c for set_name in SETS for c in set_categories(plain, set_name))
    runs = [round(ms) for ms in first["latencies_ms"]]
    assert f"{first['itl_median_ms']:.2f} ms a token" in text and f"from {runs[0]} to {min(runs[1:])}-" in text
    rest = sorted(c["itl_median_ms"] for c in others)
    assert f"against {rest[0]:.2f}-{rest[-1]:.2f} ms for its other eight" in text
    k2_long, plain_long = (
        sorted(round(ms) for ms in set_categories(record, "repeated")[2]["latencies_ms"])
        for record in (rows["AWQ + ngram_gpu K=2, padded, graphs, every plugin"], plain)
    )
    assert f"K=2's repeated/long requests took {k2_long[0]}-{k2_long[-1]} ms" in text
    assert f"the plain step's {plain_long[0]}-{plain_long[-1]} ms" in text
    assert plain["spy"]["error"].startswith("the spied request ended before py-spy's windows")
    assert not list((folder / "spy").glob("awq-broad-spied-*")), "stacks past the request's end kept"
    assert found["variant-awq-broad-ngramgpu4-spied"]["status"] == "running"


def test_the_input_slices_section_is_its_records():
    """machine31: the served table and the host-time table recomputed from the records and the kept raw stacks; the
    two plugins' own costs fell (the named self times), the step did not; the new plugins are off only in the scatter
    row; the ids the docs compare are the records' (K=2 without the plugins equal to machine30's K=2 on every pair)."""
    from serving.draft_input_ids import ENV as DRAFT_INPUT_IDS
    from serving.ngram_token_counts import ENV as NGRAM_TOKEN_COUNTS

    folder = RESULTS.parent / "h100-input-slices"
    found = lease_records(folder)
    assert_lease(found, "machine31")
    section = "# A steady verify step's input ids and token counts as slices"
    plain = found["variant-awq-broad-spied"]
    slices, scatter = (found[f"variant-awq-broad-ngramgpu2-{form}-spied"] for form in ("slices", "scatter"))
    k4 = found["variant-awq-broad-ngramgpu4-slices-spied"]
    rows = {
        "AWQ broad": plain,
        "AWQ + ngram_gpu K=2, padded, graphs, every plugin": slices,
        "AWQ + ngram_gpu K=2, padded, graphs, the two new plugins off": scatter,
        "AWQ + ngram_gpu K=4, padded, graphs, every plugin": k4,
    }
    for label, record in rows.items():
        itl_cells(section, label, record, plain)
    assert_plugins_on(plain, slices, k4)
    assert {k: v for k, v in scatter["serve_env"].items() if k.startswith("SERVING_")} == {
        DRAFT_INPUT_IDS: "0",
        NGRAM_TOKEN_COUNTS: "0",
    }
    spies = {
        "plain step, AWQ broad": plain,
        "ngram_gpu K=2, the two new plugins off": scatter,
        "ngram_gpu K=2, every plugin": slices,
        "ngram_gpu K=4, every plugin": k4,
    }
    assert_spied_rows(folder, section, spies)
    for record in (slices, scatter, k4):
        assert all(c["mean_acceptance_length"] == 1.0 for s in SETS for c in set_categories(record, s))
    off, on = scatter["spy"]["wall"]["self"], slices["spy"]["wall"]["self"]
    ids_off = named_ms(off, "_prepare_input_ids")
    ids_on = named_ms(on, "strided_input_ids.<locals>.prepare")
    counts_parts = [named_ms(off, name) for name in ("update_ngram_gpu_tensors_incremental", "_sync_num_tokens")]
    counts_on = named_ms(on, "counts_as_slice.<locals>.update")
    # the plugin's frames replace vLLM's in the stacks: vLLM's functions never ran on the plugins' server
    assert named_ms(on, "_prepare_input_ids") == named_ms(on, "_sync_num_tokens") == 0 and ids_on and counts_on
    assert ids_off + sum(counts_parts) > 2 * (ids_on + counts_on)
    doc = GPU_PROOF_DOC.read_text()
    text = " ".join(doc[doc.index(section) :].split())
    assert f"fell from {ids_off:.2f} ms a step (`_prepare_input_ids`) to {ids_on:.2f} ms" in text
    plain_ids = named_ms(plain["spy"]["wall"]["self"], "_prepare_input_ids")
    assert f"the plain step's own `_prepare_input_ids` is {plain_ids:.2f} ms" in text
    assert (
        f"from {sum(counts_parts):.2f} ms (`update_ngram_gpu_tensors_incremental` {counts_parts[0]:.2f} with "
        f"`_sync_num_tokens` {counts_parts[1]:.2f}) to {counts_on:.2f} ms" in text
    )
    assert f"Together {ids_off + sum(counts_parts):.2f} ms became {ids_on + counts_on:.2f} ms" in text
    assert f"{slices['spy']['step_ms']:.2f} ms a step with the plugins and {scatter['spy']['step_ms']:.2f} ms" in text
    assert slices["spy"]["step_ms"] >= scatter["spy"]["step_ms"]  # the step did not shorten
    grew = {
        "_prepare_inputs": (named_ms(off, "_prepare_inputs"), named_ms(on, "_prepare_inputs")),
        "sample_tokens": tuple(engine_step_part(r["spy"]["wall"], "sample_tokens") for r in (scatter, slices)),
    }
    for name, (before, after) in grew.items():
        assert f"`{name}` {before:.2f} → {after:.2f} ms" in text and after > before, name
    slow = [c["itl_median_ms"] for c in set_categories(scatter, "fresh")[:2]]
    rest = sorted(
        c["itl_median_ms"] for s in SETS for c in set_categories(scatter, s) if s != "fresh" or c["name"] == "long"
    )
    assert (
        f"ran at {slow[0]:.2f} and {slow[1]:.2f} ms a token" in text
        and f"against {rest[0]:.2f}-{rest[-1]:.2f} ms" in text
    )
    assert min(slow) > rest[-1]

    earlier = lease_records(RESULTS.parent / "h100-silent-k")
    for record, same in ((scatter, "variant-awq-broad-ngramgpu2-spied"), (plain, "variant-awq-broad-spied")):
        assert list(first_differences(record, earlier[same]).values()) == [None] * 9, same
    parted = first_differences(slices, scatter)
    positions = list(parted.values())
    assert None not in positions and f"at output tokens {min(positions)}-{max(positions)}" in text
    assert parted[("varied", "medium")] == 0 and "Varied/medium parts at token 0" in text
    session = found["session"]
    assert f"2026-11-28, {session['device_time_used_s']:,} s of device time)" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"cut those two costs from {ids_off + sum(counts_parts):.2f} to {ids_on + counts_on:.2f} ms a step" in readme
    assert f"({slices['spy']['step_ms']:.2f} ms a step with them, {scatter['spy']['step_ms']:.2f} without" in readme


def first_differences(a, b) -> dict:
    """(set, category) -> the first output position where two records' first-run ids differ (None: equal), as the
    pipeline's lossless check finds it."""
    from lib.lossless import compare

    rows = compare(a["probe"], b["probe"])
    assert not any(row["problem"] for row in rows), rows
    return {(row["set"], row["category"]): (row["first_difference"] or {}).get("position") for row in rows}


def ratio_range(record, plain) -> str:
    """The lowest and highest per-set mean ITL of `record` against `plain`'s, as the docs write a range."""
    return span([mean_itl(record, s) / mean_itl(plain, s) for s in SETS]) + "x"


def test_the_autotune_kept_section_is_its_records():
    """machine32: the served table and the host-time table recomputed from the records and the kept raw stacks; the
    first start timed its kernels and the later ones none (their logs); two plain starts give the same ids, and the
    speculative start on the same picks parts at the prefill's token; that token's tally over the project's records;
    the same code's silent step against machine31's and machine30's."""
    from gpu_proof.driver import VARIANTS

    folder = RESULTS.parent / "h100-autotune-kept"
    found = lease_records(folder)
    assert_lease(found, "machine32")
    section = "# Kept autotune picks, and a second start of each form"
    plain, again = found["variant-awq-broad-spied"], found["variant-awq-broad-again"]
    k2 = found["variant-awq-broad-ngramgpu2-slices-spied"]
    rows = {
        "AWQ broad": plain,
        "AWQ broad, second start": again,
        "AWQ + ngram_gpu K=2, padded, graphs, every plugin": k2,
    }
    for label, record in rows.items():
        itl_cells(section, label, record, plain)
        assert record["status"] == "ok" and record["serve_env"]["TRITON_PRINT_AUTOTUNING"] == "1", label
    assert_plugins_on(plain, again, k2)
    assert all(c["mean_acceptance_length"] == 1.0 for s in SETS for c in set_categories(k2, s))
    # the later starts began on the first start's cache: what makes their picks its picks
    for name in ("awq-broad-again", "awq-broad-ngramgpu2-slices-spied", "awq-broad-ngramgpu2-slices-again"):
        assert VARIANTS[name]["first"] == "from:awq-broad-spied", name
    assert found["variant-awq-broad-ngramgpu2-slices-again"]["status"] == "running"  # lost with the lease

    spies = {"plain step, AWQ broad": plain, "ngram_gpu K=2, every plugin": k2}
    assert_spied_rows(folder, section, spies)

    doc = GPU_PROOF_DOC.read_text()
    text = " ".join(doc[doc.index(section) :].split())
    starts = (
        "awq-broad-spied",
        "awq-broad-again",
        "awq-broad-ngramgpu2-slices-spied",
        "awq-broad-ngramgpu2-slices-again",
    )
    logs = {name: (folder / "logs" / f"machine32-{name}-first.log").read_text() for name in starts}
    timed = {name: log.count("Autotuning kernel") for name, log in logs.items()}
    kernels = set(re.findall(r"Triton autotuning for function (\w+)", logs["awq-broad-spied"]))
    first_timed = timed.pop("awq-broad-spied")
    assert first_timed > 0 and set(timed.values()) == {0}, timed
    assert f"timed {first_timed} configs of {len(kernels)} kernels" in text
    assert any(kernel.startswith("chunk_") for kernel in kernels)

    m31 = lease_records(RESULTS.parent / "h100-input-slices")
    m30 = lease_records(RESULTS.parent / "h100-silent-k")
    for other in (again, m31["variant-awq-broad-spied"], m30["variant-awq-broad-spied"]):
        assert list(first_differences(plain, other).values()) == [None] * 9, other["machine"]
    assert first_differences(k2, plain)[("varied", "medium")] == 0
    again_ratios = [mean_itl(again, s) / mean_itl(plain, s) for s in SETS]
    assert f"differs by {min(again_ratios):.2f}-{max(again_ratios):.2f}x" in text

    # varied/medium's first token over every AWQ broad record since machine8 (the tied random checkpoint), and bf16's
    records_by_token, plain_hosts, bf16_hosts = Counter(), defaultdict(set), defaultdict(set)
    for path in RESULTS.parent.glob("h100-*/variant-*.json"):
        record = json.loads(path.read_text())
        medium = ((record.get("probe") or {}).get("varied") or {}).get("categories", [None, None])[1]
        machine = int(record["machine"].removeprefix("machine"))
        if not medium or not medium.get("first_run_token_ids") or machine < 8:
            continue
        token = medium["first_run_token_ids"][0]
        if record.get("recipe") == BROAD_RECIPE:
            records_by_token[token] += 1
            if record["speculative"]["method"] == "none":
                plain_hosts[token].add(machine)
        elif record["variant"].startswith("bf16"):
            bf16_hosts[token].add(machine)
    plain_token = set_categories(plain, "varied")[1]["first_run_token_ids"][0]
    k2_token = set_categories(k2, "varied")[1]["first_run_token_ids"][0]
    assert set(records_by_token) == set(plain_hosts) == {plain_token, k2_token}
    assert (
        f"{plain_token} ({records_by_token[plain_token]} records) or {k2_token} ({records_by_token[k2_token]}), plain "
        f"starts included ({plain_token} on {len(plain_hosts[plain_token])} hosts, {k2_token} on "
        f"{len(plain_hosts[k2_token])})" in text
    )
    assert len(bf16_hosts) == 1 and f"the same on all {len(next(iter(bf16_hosts.values())))} hosts" in text

    m31_range = ratio_range(m31["variant-awq-broad-ngramgpu2-slices-spied"], m31["variant-awq-broad-spied"])
    assert f"costs {ratio_range(k2, plain)} a plain one" in text
    assert (
        f"cost {m31_range} on machine31 "
        f"({ratio_range(m30['variant-awq-broad-ngramgpu2-spied'], m30['variant-awq-broad-spied'])} on machine30" in text
    )
    before, after = m31["variant-awq-broad-ngramgpu2-slices-spied"]["spy"], k2["spy"]
    assert (
        f"host work is {after['step_ms'] - after['wall']['gpu_wait']['ms_per_step']:.2f} ms a step against "
        f"machine31's {before['step_ms'] - before['wall']['gpu_wait']['ms_per_step']:.2f} ms" in text
    )
    parts = {
        "`_prepare_inputs`": "_prepare_inputs",
        "the GDN spec metadata": "build_all_spec",
        "the greedy rejection": "greedy_forward.<locals>.forward",
        "the token counts": "counts_as_slice.<locals>.update",
    }
    for words, name in parts.items():
        old, new = (named_ms(spy["wall"]["self"], name) for spy in (before, after))
        assert f"{words} {old:.2f} → {new:.2f}" in text and new > old, name
    assert f"thread hardly waits for the GPU ({after['wall']['gpu_wait']['ms_per_step']:.2f} ms a step)" in text
    assert f"2026-11-28, {found['session']['device_time_used_s']:,} s of device time" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"same silent K=2 step cost {ratio_range(k2, plain)} a plain one, against {m31_range} on the fourth" in readme
    )


def test_the_environment_names_the_host_cpu_a_host_bound_step_follows():
    """The driver's environment record carries the CPU model, the cores' clock range and the governor, read from
    /proc/cpuinfo (this machine's, and a two-model text), valid against the record's schema."""
    from gpu_proof.driver import host_cpu

    mixed = (
        "processor\t: 0\nmodel name\t: CPU B\ncpu MHz\t\t: 3400.5\n\n"
        "processor\t: 1\nmodel name\t: CPU A\ncpu MHz\t: 1500\n"
    )
    assert host_cpu(mixed, "performance") == {
        "model": "CPU A / CPU B",
        "mhz_min_max": [1500.0, 3400.5],
        "governor": "performance",
    }
    assert host_cpu("", None) == {"model": None, "mhz_min_max": None, "governor": None}
    here = host_cpu(Path("/proc/cpuinfo").read_text(), None)
    assert here["model"] and here["model"] in Path("/proc/cpuinfo").read_text()
    environment = {
        "kind": "environment",
        "status": "ok",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "driver": "580", "memory_total": "81559 MiB"},
        "versions": {
            "host": {},
            "vllm_bundle": {"vllm": "0.26.0"},
            "llmcompressor_bundle": {"llmcompressor": "absent"},
        },
        "python": "3.12.3",
        "torch_cuda": "13.0",
        "driver_command": "python3 gpu_proof/driver.py",
    }
    for cpu in (here, host_cpu(mixed, "performance")):
        jsonschema.validate({**environment, "cpu": cpu}, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**environment, "cpu": {**here, "mhz_min_max": [1.0]}}, SCHEMA)


def test_kernel_picks_read_triton_and_inductor_tuning_from_a_cache_and_say_which_differ(tmp_path):
    """The driver's record of what a start's autotuned kernels picked: Triton's kept result (its fastest config) and
    inductor's best config without its timing; two caches compared kernel by kernel, a seeded copy of the same pick
    not counted as a difference, another pick for the same inductor kernel under another compile hash counted."""
    from gpu_proof.driver import INDUCTOR_NOT_PICKS, differing_picks, kernel_picks

    def write(cache: Path, relative: str, data) -> None:
        path = cache / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data if isinstance(data, str) else json.dumps(data))

    slow = {"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 2}
    fast = {"kwargs": {"BK": 128}, "num_warps": 2, "num_stages": 3}
    tuned = {"key": [2048, "torch.bfloat16"], "configs_timings": [[slow, [0.020, 0.019]], [fast, [0.015, 0.016]]]}
    best = {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16, "num_stages": 1, "configs_hash": "c1"}
    best = {**best, "found_by_coordesc": False, "time_taken_ms": 3, "triton_cache_hash": "t1"}
    inductor = "vllm/torch_compile_cache/torch_aot_compile/{}/inductor_cache/ab/cabc.best_config"
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    for cache in (plain, spec):
        write(cache, "triton/H0/chunk_fwd_kernel_o.autotune.json", tuned)
        write(cache, inductor.format("P"), best)  # the spec cache was seeded from the plain one
    write(plain, "triton/H9/broken.autotune.json", "{")
    write(spec, inductor.format("S"), {**best, "R0_BLOCK": 512})  # the spec variant's own compile hash

    picks = kernel_picks(plain)
    assert picks["triton"] == {"H0/chunk_fwd_kernel_o.autotune.json": {"key": tuned["key"], "config": fast}}
    assert picks["inductor"] == {inductor.format("P"): {k: v for k, v in best.items() if k not in INDUCTOR_NOT_PICKS}}
    assert picks["unreadable"] == 1
    assert differing_picks(picks, picks) == {
        "triton": {"shared": 1, "differ": []},
        "inductor": {"shared": 1, "differ": []},
    }
    assert differing_picks(picks, kernel_picks(spec)) == {
        "triton": {"shared": 1, "differ": []},
        "inductor": {"shared": 1, "differ": ["cabc.best_config"]},
    }
    record = lease_records(RESULTS.parent / "h100-autotune-kept")["variant-awq-broad-spied"]
    jsonschema.validate({**record, "kernel_picks": picks}, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**record, "kernel_picks": {**picks, "unreadable": -1}}, SCHEMA)


def plain_h100_records(recipe) -> dict[str, dict]:
    """machine -> the H100 records of `recipe` served without speculation, every plugin at its default on runner V1
    (no SERVING_* switch, no other kernel or runner: the form the H200 section compares with), probed."""
    quiet = {"VLLM_USE_FLASHINFER_SAMPLER", "TRITON_PRINT_AUTOTUNING"}
    found = defaultdict(list)
    for path in sorted(RESULTS.parent.glob("h100*/variant-*.json")):
        record = json.loads(path.read_text())
        if record["status"] != "ok" or not record.get("probe"):
            continue
        if record["recipe"] != recipe or record["speculative"]["method"] != "none":
            continue
        if set(record.get("serve_env") or {}) - quiet:
            continue
        if record["serve_settings"].get("model_runner") not in (None, "v1"):
            continue
        found[record["machine"]].append(record)
    return found


def probed_sets(*records) -> list[str]:
    """The prompt sets every one of `records` probed (the earliest leases probed only some)."""
    return [s for s in SETS if s == "repeated" or all(r["probe"].get(s) for r in records)]


def test_the_h200_section_is_its_records():
    """machine33-34: the served table from the records; the H100 ranges it compares with, over every plain record of
    the same form; the weights' bound and the work beyond it; the prefill times, the autotune counts, where the ids
    part from the H100s', the bandwidth and the CPU the records name."""
    folder = RESULTS.parent / "h200"
    found = lease_records(folder)
    assert_lease(found, "machine33", "machine34")
    section = "# The first H200: faster memory, the same quantized token"
    awq, bf16 = found["variant-awq-broad-spied-profile"], found["variant-bf16-base"]
    assert awq["status"] == "running" and bf16["status"] == "ok"  # AWQ broad's profile was lost with machine33
    assert (awq["machine"], bf16["machine"]) == ("machine33", "machine34")
    itl_cells(section, "AWQ broad (machine33)", awq, awq, bf16)
    itl_cells(section, "bf16 (machine34)", bf16, awq)
    assert_plugins_on(awq, bf16)
    doc = GPU_PROOF_DOC.read_text()
    text = " ".join(doc[doc.index(section) :].split())

    awq_itls = [mean_itl(awq, s) for s in SETS]
    h100_awq, h100_bf16 = plain_h100_records(BROAD_RECIPE), plain_h100_records(None)
    h100_awq_itls, h100_bf16_itls = (
        [mean_itl(r, s) for rs in by_machine.values() for r in rs for s in probed_sets(r)]
        for by_machine in (h100_awq, h100_bf16)
    )
    assert f"took {span(awq_itls)} ms here, against {span(h100_awq_itls)} ms on {len(h100_awq)} H100 hosts" in text
    assert f"fell from {span(h100_bf16_itls)} ms ({len(h100_bf16)} H100 hosts) to {mean_itl(bf16):.2f} ms" in text
    assert len({round(mean_itl(bf16, s), 2) for s in SETS}) == 1

    # the weights' time at this GPU's copy rate, and what each token takes beyond it
    awq_bound = {c["weights_bound_ms"] for c in awq["decode"]["categories"]}.pop()
    bf16_bound = {c["weights_bound_ms"] for c in bf16["decode"]["categories"]}.pop()
    assert f"would take {awq_bound:.2f} ms, and its token is {span([i / awq_bound for i in awq_itls], 1)}x that" in text
    assert f"would take {bf16_bound:.2f} ms, and its token is {mean_itl(bf16) / bf16_bound:.2f}x that" in text

    def beyond(record):
        return [c["itl_median_ms"] - c["weights_bound_ms"] for c in record["decode"]["categories"]]

    h100_beyond = [gap for rs in h100_bf16.values() for r in rs for gap in beyond(r)]
    assert f"plus {span(beyond(bf16))} ms here, and plus {span(h100_beyond)} ms on {len(h100_bf16)} H100 hosts" in text

    # AWQ broad against bf16 on the H100 hosts that served both: per set, and on the competition's set alone
    def speedups(fast, slow):
        return {s: speedup_over(slow, fast, s) for s in probed_sets(fast, slow)}

    both = [(h100_awq[m][0], h100_bf16[m][0]) for m in sorted(set(h100_awq) & set(h100_bf16))]
    h100_sets = [speedups(a, b) for a, b in both]
    here = speedups(awq, bf16)
    assert f"AWQ broad is {span(here.values())}x bf16 here" in text
    assert f"against {span([v for d in h100_sets for v in d.values()])}x on the {len(both)} H100 hosts" in text
    competition = [d["repeated"] for d in h100_sets]
    assert f"({span(competition)}x on the competition set, where the H200 gives {here['repeated']:.2f}x)" in text
    assert here["repeated"] < min(competition)

    # prefill of the long category, the starts, the autotuned configs
    h100_awq_spied = [
        lease_records(RESULTS.parent / f)["variant-awq-broad-spied"]
        for f in ("h100-input-slices", "h100-autotune-kept")
    ]

    def long_ttfts(record):
        return [set_categories(record, s)[2]["ttft_median_ms"] for s in SETS]

    assert f"came after {span(long_ttfts(awq), 0)} ms for AWQ broad and {span(long_ttfts(bf16), 0)} ms for bf16" in text
    m32 = h100_awq_spied[1]
    assert m32["machine"] == "machine32" and m32["cold_start"]["first_start_cache"] == "empty"
    assert f"AWQ broad answered after {awq['cold_start']['empty_cache_s']:.0f} s" in text
    assert f"({m32['cold_start']['empty_cache_s']:.0f} s on machine32)" in text
    assert f"bf16 after {bf16['cold_start']['empty_cache_s']:.0f} s" in text
    logs = [folder / "logs" / f"{r['machine']}-{r['variant']}-first.log" for r in (awq, bf16)]
    timed = {log.read_text().count("Autotuning kernel") for log in logs}
    assert len(timed) == 1 and f"Both timed {timed.pop()} autotune configs" in text

    # where the ids part from the H100s'
    def parting(record, others):
        positions = [p for other in others for p in first_differences(record, other).values()]
        assert None not in positions
        return f"{min(positions)}-{max(positions)}"

    h100_bf16_refs = [
        lease_records(RESULTS.parent / "h100-suffix-plugins")["variant-bf16-all"],
        lease_records(RESULTS.parent / "h100-runner2-lossless")["variant-bf16-reference"],
    ]
    assert (
        f"at output tokens {parting(awq, h100_awq_spied)} for AWQ broad and {parting(bf16, h100_bf16_refs)} for bf16"
        in text
    )

    # the hosts: bandwidth, the H100s' range, the CPU
    copies = [found[n]["copy_gbps"] for n in ("bandwidth", "bandwidth-machine34")]
    h100_copies = [json.loads(p.read_text())["copy_gbps"] for p in RESULTS.parent.glob("h100*/bandwidth*.json")]
    assert f"measured {min(copies):,.0f} and {max(copies):,.0f} GB/s" in text
    assert f"a GPU {min(copies) / max(h100_copies):.1f}x faster at reading weights" in text
    assert (
        f"against {min(h100_copies):,.0f}-{max(h100_copies):,.0f} GB/s on every H100 host ({len(h100_copies)} records)"
        in text
    )
    for name in ("environment", "environment-machine34"):
        cpu = found[name]["cpu"]
        assert cpu["governor"] is None and f'"{cpu["model"]}" at {cpu["mhz_min_max"][1]:,.0f} MHz' in text
        assert found[name]["gpu"]["name"] == "NVIDIA H200"
    session = found["session"]
    assert f"2026-11-28, {session['device_time_used_s']:,} s of device time)" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"copying at {min(copies):,.0f}-{max(copies):,.0f} GB/s" in readme
    assert f"fell from {span(h100_bf16_itls)} ms on the H100 hosts to {mean_itl(bf16):.2f} ms" in readme
    assert f"stayed at {span(awq_itls)} ms ({span(h100_awq_itls)} on the H100s), " in readme
    assert f"{span([i / awq_bound for i in awq_itls], 1)}x the time its weights take" in readme
    assert f"AWQ broad is {here['repeated']:.2f}x bf16 on the competition set there ({span(competition)}x" in readme
