"""The GPU proof: the committed records validate and name variants of the catalog users run, and the driver that
writes them plans from that catalog and runs its start/probe/lossless flow against a fake server (no GPU)."""

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import ROOT

RECORDS = ROOT / "records" / "gpu-proof"
SCHEMA = yaml.safe_load((ROOT / "schemas" / "gpu-proof.schema.yaml").read_text())
sys.path.insert(0, str(ROOT / "gpu_proof"))
sys.path.insert(0, str(ROOT / "tools"))

from render_results import RENAMED  # noqa: E402

import collect  # noqa: E402
import driver  # noqa: E402
import plan  # noqa: E402
import records  # noqa: E402
import steps  # noqa: E402


@pytest.fixture(scope="module")
def pipeline():
    return plan.catalog(ROOT / "config.yaml")


@pytest.fixture(autouse=True)
def own_host_markers(tmp_path, monkeypatch):
    """Each test its own folders of starting and resident servers' markers: another run of the suite on this machine
    is no server of this test's host."""
    monkeypatch.setattr(records, "STARTING", tmp_path / "starting")
    monkeypatch.setattr(records, "RESIDENT", tmp_path / "resident")


def committed() -> dict[Path, dict]:
    return {path: json.loads(path.read_text()) for path in sorted(RECORDS.glob("*/*.json"))}


def without_nulls(section: dict) -> dict:
    return {key: value for key, value in section.items() if value is not None}


def test_the_records_validate_and_are_the_catalogs_variants(pipeline):
    """What the tables cite is a catalog variant as users run it (its recipe and speculative settings), measured on
    a named host whose environment is recorded, in the folder of its GPU model; trained-weight records are variants
    of the tiny profile's catalog, random-weight ones of config.yaml's (a sweep point measured under an older name
    under the name the tables give it)."""
    catalogs = {"config.yaml": pipeline, "config/tiny.yaml": plan.catalog(ROOT / "config" / "tiny.yaml")}
    records = committed()
    assert records, "no GPU records"
    hosts = {(r["gpu"], r["host"]) for r in records.values() if r["kind"] == "environment"}
    for path, record in records.items():
        jsonschema.validate(record, SCHEMA)
        assert path.parent.name == collect.gpu_model(record["gpu"]), path
        assert path.name.startswith(f"{record['host']}-"), path
        assert (record["gpu"], record["host"]) in hosts, f"{path}: no environment record of its host"
        if record["kind"] == "environment":
            continue
        config = record.get("config") or ("config/tiny.yaml" if record["weights"] == "trained" else "config.yaml")
        assert (config == "config/tiny.yaml") == (record["weights"] == "trained"), path
        names = [record["variant"]] if record["kind"] == "variant" else []
        names += [n for c in record.get("checks", []) for n in (c["variant"], c["reference_variant"])]
        for name in map(lambda n: RENAMED.get(n, n), names):
            assert name in catalogs[config].config["variants"], f"{path}: {name} is not in {config}'s catalog"
        if record["kind"] == "variant":
            catalog = catalogs[config].config["variants"][RENAMED.get(record["variant"], record["variant"])]
            assert record["recipe"] == catalog["recipe"], path
            assert without_nulls(record["speculative"]) == without_nulls(catalog["speculative"]), path


def test_quantized_variants_read_fewer_bytes_than_bf16_on_their_host():
    records = [r for r in committed().values() if r["kind"] == "variant" and r["bytes_per_step"]]
    bf16 = {r["host"]: r["bytes_per_step"] for r in records if r["variant"] == "bf16"}
    compared = [r for r in records if r["host"] in bf16 and r["recipe"] != "recipes/bf16.yaml"]
    assert compared
    for record in compared:
        assert record["bytes_per_step"] < bf16[record["host"]], (record["host"], record["variant"])


# ---- the driver, against tests/support/serving_standin.py ----


def write_checkpoint(folder: Path) -> None:
    header = {
        "model.language_model.layers.0.mlp.up_proj.weight": [0, 1000],
        "model.language_model.embed_tokens.weight": [1000, 1500],
        "mtp.fc.weight": [1500, 1600],
    }
    blob = json.dumps({n: {"dtype": "BF16", "shape": [1], "data_offsets": o} for n, o in header.items()}).encode()
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(1600))
    (folder / "config.json").write_text("{}")


def fake_driver(tmp_path, pipeline, names, **options):
    """A Driver serving tests/support/serving_standin.py, its environment, checkpoint, bandwidth and quantize steps
    done."""
    d = steps.Driver(tmp_path, names, pipeline, {"warmup": 1, "runs": 2, **options})
    d.serve_cmd = [sys.executable, str(ROOT / "tests" / "support" / "serving_standin.py")]
    write_checkpoint(d.model_dir)
    shutil.copytree(d.model_dir, tmp_path / "quant" / "awq-w4a16-g32-broad" / "model")
    environment = {"gpu": {"name": "NVIDIA H200"}, "versions": {"vllm_bundle": {"vllm": "0.26.0"}}}
    d.record(
        "environment", {"kind": "environment", "status": "ok", "cpu": "a CPU", "date": "2026-11-28", **environment}
    )
    d.record("checkpoint", {"kind": "checkpoint", "status": "ok"})
    d.record("bandwidth", {"kind": "bandwidth", "status": "ok", "copy_gbps": 4000.0})
    for step in ("environment", "checkpoint", "bandwidth", "quantize-awq-w4a16-g32-broad"):
        (d.done / step).write_text("0\n")
    return d


def test_the_driver_serves_catalog_variants_together_and_checks_them_lossless(tmp_path, pipeline):
    """Two groups of two: each group's servers start at once on a shared GPU, are probed one at a time, and the
    second group starts on the first's kernel caches; the speculative variant is compared with the
    no-speculation variant of its recipe, whose server also ran the reference requests; collect.py writes the
    small records the tables cite."""
    names = ["bf16", "awq-w4a16-g32-none", "awq-w4a16-g32-mtp2", "awq-w4a16-g32-suffix24-pad"]
    d = fake_driver(tmp_path, pipeline, names, together=2)
    d.run()
    results = tmp_path / "results"
    records = {n: json.loads((results / f"variant-{n}.json").read_text()) for n in names}
    assert all(r["status"] == "ok" for r in records.values()), {n: r.get("error") for n, r in records.items()}
    assert [records[n]["cold_start"]["cache"] for n in names] == ["empty", "empty", "seeded", "seeded"]
    for record in records.values():  # gpu_memory_utilization shared by the two servers started together
        assert record["serve"]["gpu_memory_utilization"] == record["options"]["gpu_memory_utilization"] == 0.44
        assert record["serve"]["extra_args"][-2:] == ["--kv-cache-memory-bytes", str(8 * 2**30)]
        assert record["serve"]["gdn_prefill_backend"] == "triton"  # config.yaml's serve section, as a user's image
        assert set(record["probe"]["varied"] or {}) and record["probe"]["runs"] == 2
    assert "reference" in records["awq-w4a16-g32-none"] and "reference" not in records["bf16"]
    assert records["awq-w4a16-g32-mtp2"]["bytes_per_step"] == 1000 + 500 + 2 * (100 + 500)
    lossless = json.loads((results / "lossless.json").read_text())
    assert [(c["variant"], c["reference_variant"], c["passed"]) for c in lossless["checks"]] == [
        ("awq-w4a16-g32-mtp2", "awq-w4a16-g32-none", True),
        ("awq-w4a16-g32-suffix24-pad", "awq-w4a16-g32-none", True),
    ]
    written = collect.collect(tmp_path / "results.tar.gz", "host1", tmp_path / "records")
    assert sorted(p.name for p in written) == sorted(
        [f"host1-vllm0.26.0-{n}.json" for n in [*names, "environment", "lossless"]]
    )
    compact = json.loads((tmp_path / "records" / "h200" / "host1-vllm0.26.0-awq-w4a16-g32-mtp2.json").read_text())
    assert (compact["engine"], compact["weights"], compact["config"]) == ("0.26.0", "random", "config.yaml")
    assert "first_run_token_ids" not in json.dumps(compact) and set(compact["sets"]) == {"repeated", "varied", "fresh"}


def test_a_relaunch_skips_what_is_done_and_a_failed_start_leaves_the_others_probed(tmp_path, pipeline):
    names = ["awq-w4a16-g32-none", "awq-w4a16-g32-head4-vocab131k-none"]  # the second has no quantized model
    d = fake_driver(tmp_path, pipeline, names, together=2)
    (d.done / "quantize-awq-w4a16-g32-broad-head4-vocab131k").write_text("0\n")
    d.run()
    results = tmp_path / "results"
    failed = json.loads((results / f"variant-{names[1]}.json").read_text())
    assert failed["status"] == "failed" and "did not finish" in failed["error"]
    assert json.loads((results / f"variant-{names[0]}.json").read_text())["status"] == "ok"
    assert not (d.done / "serve-1").exists() and (results / "failed-serve-1.json").exists()
    probed_at = (results / f"variant-{names[0]}.json").stat().st_mtime_ns
    d.run()  # the relaunch serves only what is not done
    assert (results / f"variant-{names[0]}.json").stat().st_mtime_ns == probed_at


def test_a_speculative_variant_without_its_reference_in_the_run_leaves_no_lossless_verdict(tmp_path, pipeline):
    """The driver records why nothing was compared; collect.py keeps no lossless record for it (an empty failed
    check is not a verdict on the method)."""
    names = ["bf16", "awq-w4a16-g32-mtp2"]  # no AWQ variant without speculation: no reference for the MTP one
    d = fake_driver(tmp_path, pipeline, names, together=2)
    d.run()
    (check,) = json.loads((tmp_path / "results" / "lossless.json").read_text())["checks"]
    assert check["reference_variant"] is None and check["failures"]
    written = collect.collect(tmp_path / "results.tar.gz", "host1", tmp_path / "records")
    assert sorted(p.name for p in written) == sorted(f"host1-vllm0.26.0-{n}.json" for n in [*names, "environment"])


def test_a_restart_on_the_first_starts_cache_is_timed_and_a_canary_against_other_weights_fails(tmp_path, pipeline):
    """--restart: each server started again on the cache its first start filled (the bake's cache) is timed beside
    the first start, with vLLM's compile lines of both; --reference-for: a variant checked against another recipe's
    reference (other weights, other greedy ids) fails the lossless check, and the record says it was a canary."""
    names = ["bf16", "awq-w4a16-g32-none", "awq-w4a16-g32-mtp2"]
    options = {
        "restart": ["bf16", "awq-w4a16-g32-none"],
        "reference_for": {"awq-w4a16-g32-mtp2": "bf16"},
        "serve_env": {"FAKE_DELAY_S": "2.5"},
        "serve_set": {"enable_prefix_caching": True},
    }
    d = fake_driver(tmp_path, pipeline, names, together=3, **options)
    d.serve_cmd = [sys.executable, str(ROOT / "tests" / "support" / "serving_standin.py")]
    d.run()
    results = tmp_path / "results"
    records = {n: json.loads((results / f"variant-{n}.json").read_text()) for n in names}
    assert "warm_start" not in records["awq-w4a16-g32-mtp2"]  # not among --restart's
    for record in [records["bf16"], records["awq-w4a16-g32-none"]]:
        assert record["status"] == "ok", record.get("error")
        assert record["cold_start"]["compile_log"] == ["torch.compile took 1.00 s in total"]
        assert record["warm_start"]["compile_log"] == ["Directly load AOT compilation from path"]
        assert record["warm_start"]["seconds"] < record["cold_start"]["seconds"]  # the fake's warm start is instant
    assert "reference" in records["bf16"]  # a canary's reference runs on its server though nothing speculates on bf16
    lossless = json.loads((results / "lossless.json").read_text())
    (check,) = lossless["checks"]
    assert (check["variant"], check["reference_variant"], check["passed"]) == ("awq-w4a16-g32-mtp2", "bf16", False)
    assert "canary" in check
    # one of several drivers on the host (--run): its files carry its name; a check carries what its run changed
    written = collect.collect(tmp_path / "results.tar.gz", "host1", tmp_path / "records", run="cached")
    kept = {p.name: json.loads(p.read_text()) for p in written}
    (check,) = kept["host1-vllm0.26.0-cached-lossless.json"]["checks"]
    assert "canary" in check and check["options"] == {"serve_set": {"enable_prefix_caching": True}}
    assert kept["host1-vllm0.26.0-cached-bf16.json"]["warm_start"]["compile_log"]
    for record in kept.values():
        jsonschema.validate(record, SCHEMA)
    with pytest.raises(plan.PlanError, match="awq-w4a16-g32-none"):
        driver.main(["--variants", "bf16", "--reference-for", "bf16=awq-w4a16-g32-none", "--plan"])


def test_a_given_trained_checkpoint_and_quantized_model_are_served_with_every_patch_off(tmp_path):
    """The trained-weights proof: the tiny profile's catalog, its checkpoint and quantized model made on a CPU by the
    pipeline (--checkpoint, --quantized), every patch off (--patches off: a new engine before the patches are
    re-decided); nothing random is built, the given checkpoint is described by its files' digests."""
    tiny = plan.catalog(ROOT / "config" / "tiny.yaml")
    given, quantized = tmp_path / "given", tmp_path / "given-awq"
    write_checkpoint(given)
    (given / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": {
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                    "num_key_value_heads": 2,
                    "head_dim": 128,
                    "linear_num_value_heads": 2,
                    "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128,
                },
            }
        )
    )
    shutil.copytree(given, quantized)
    names = ["tiny-awq-none", "tiny-awq-mtp2"]
    options = {"warmup": 1, "runs": 1, "checkpoint": str(given), "patches": "off", "config": "config/tiny.yaml"}
    d = steps.Driver(tmp_path / "state", names, tiny, options | {"quantized": {"awq-w4a16-g32-broad": str(quantized)}})
    d.serve_cmd = [sys.executable, str(ROOT / "tests" / "support" / "serving_standin.py")]
    d.record("environment", {"kind": "environment", "status": "ok", "gpu": {"name": "NVIDIA H200"}})
    d.record("bandwidth", {"kind": "bandwidth", "status": "ok", "copy_gbps": 4000.0})
    for step in ("environment", "bandwidth"):
        (d.done / step).write_text("0\n")
    d.run()
    results = tmp_path / "state" / "results"
    checkpoint = json.loads((results / "checkpoint.json").read_text())
    digest = hashlib.sha256((given / "model.safetensors").read_bytes()).hexdigest()
    assert checkpoint["weights_sha256"] == {"model.safetensors": digest}
    assert checkpoint["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert not (tmp_path / "state" / "weights").exists() and not any((tmp_path / "state" / "quant").iterdir())
    for name in names:
        record = json.loads((results / f"variant-{name}.json").read_text())
        assert record["status"] == "ok", record.get("error")
        assert record["options"]["patches"] == "off" and not any(record["serve"]["patches"].values())
        assert record["serve"]["max_model_len"] == tiny.config["variants"][name]["serve"]["max_model_len"]
    lossless = json.loads((results / "lossless.json").read_text())
    assert [(c["variant"], c["reference_variant"]) for c in lossless["checks"]] == [("tiny-awq-mtp2", "tiny-awq-none")]
    # what collect.py keeps of it: trained records of the tiny catalog, on the engine the environment names, with the
    # engine's own step (gpu_proof/floor.py) and a note on the run's conditions
    floor = {"kind": "floor", "status": "ok", "vllm": "0.26.0", "tokens": 256, "step_median_ms": 2.1, "runs": [{}]}
    d.record("floor-tiny-awq-none", floor)
    d.record(
        "environment",
        {
            "kind": "environment",
            "status": "ok",
            "gpu": {"name": "NVIDIA H200"},
            "cpu": None,
            "date": "2026-11-29",
            "versions": {"vllm_bundle": {"vllm": "0.26.0+cu130"}},
        },
    )
    written = collect.collect(
        tmp_path / "state" / "results.tar.gz", "host9", tmp_path / "records", note="a caveat", host_busy=True
    )
    kept = {p.name: json.loads(p.read_text()) for p in written}
    assert kept["host9-vllm0.26.0-floor-tiny-awq-none.json"]["step_median_ms"] == 2.1
    mtp = kept["host9-vllm0.26.0-tiny-awq-mtp2.json"]
    assert (mtp["weights"], mtp["config"], mtp["engine"], mtp["note"]) == (
        "trained",
        "config/tiny.yaml",
        "0.26.0",
        "a caveat",
    )
    assert mtp["host_busy"] is True and "host_busy" not in kept["host9-vllm0.26.0-lossless.json"]
    assert kept["host9-vllm0.26.0-lossless.json"]["weights"] == "trained"
    assert kept["host9-vllm0.26.0-lossless.json"]["note"] == "a caveat"  # which checkpoint a canary served, say
    with pytest.raises(plan.PlanError, match="no-such-recipe"):
        driver.main(
            [
                "--config",
                str(ROOT / "config" / "tiny.yaml"),
                "--variants",
                "tiny-awq-none",
                "--plan",
                "--quantized",
                "no-such-recipe=/x",
            ]
        )


def test_a_variant_the_catalog_does_not_define_is_refused_before_any_step(tmp_path, pipeline):
    with pytest.raises(plan.PlanError, match="awq-no-such-variant"):
        driver.main(["--variants", "bf16,awq-no-such-variant", "--state", str(tmp_path / "state")])
    assert not (tmp_path / "state").exists()
    variants = {"drafted": {"recipe": "recipes/awq-w4a16-g32-broad.yaml", "speculative": {"method": "dflash", "k": 15}}}
    with pytest.raises(plan.PlanError, match="--random-drafter"):
        plan.plan_steps(["drafted"], variants, 1, random_drafter=False)
    assert plan.plan_steps(["drafted"], variants, 1, random_drafter=True) == [
        "environment",
        "checkpoint",
        "bandwidth",
        "quantize-awq-w4a16-g32-broad",
        "drafter",
        "serve-1",
        "lossless",
    ]


def test_a_profiled_first_step_sums_the_gdn_op_the_runners_scopes_and_the_gpus_busy_union():
    """floor.summarize_profile: host time a GDN call, each model-runner scope's host time (summed over its calls),
    and the GPU's busy time with overlapping kernels counted once."""
    from types import SimpleNamespace

    import floor

    def event(name, start, end, device="DeviceType.CPU"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event(floor.GDN_OP, 0, 300),
        event(floor.GDN_OP, 1000, 1500),
        event("gpu_model_runner: draft", 2000, 6000),
        event("gpu_model_runner: draft", 7000, 8000),
        event("gpu_model_runner: bookkeep", 8000, 8500),
        event("aten::index", 0, 9000),
        event("kernel", 0, 2000, "DeviceType.CUDA"),
        event("kernel", 1000, 3000, "DeviceType.CUDA"),
        event("kernel", 5000, 6000, "DeviceType.CUDA"),
    ]
    summary = floor.summarize_profile(events)
    assert summary["gdn_calls"] == 2 and summary["gdn_host_ms_per_call"] == 0.4
    assert summary["runner_scopes_ms"] == {"bookkeep": 0.5, "draft": 5.0}
    assert summary["gpu_busy_ms"] == 4.0
    assert "runner_scopes_ms" not in floor.summarize_profile(events[:2])


def test_the_floor_measures_the_engine_with_the_servers_settings_less_the_front_ends_flags():
    """gpu_proof/floor.py builds vLLM's engine from the image's own command line, without the API server's flags."""
    import floor
    from serving.settings import vllm_args

    tiny = plan.catalog(ROOT / "config" / "tiny.yaml")
    args = vllm_args(tiny.serve_json("tiny-awq-none"), "/m", host="127.0.0.1", port=0, cuda=True)
    flags = floor.engine_flags(args)
    assert "--max-num-seqs" in flags and "/m" in flags
    assert not {f.split("=", 1)[0] for f in flags} & floor.FRONT_END_FLAGS
    assert len(args) - len(flags) == sum(
        2 if "=" not in a else 1 for a in args if a.split("=")[0] in floor.FRONT_END_FLAGS
    )


def test_a_second_driver_on_the_host_takes_the_first_ones_weights_and_times_only_under_the_host_lock(
    tmp_path, pipeline, monkeypatch
):
    """--share-state: another engine measured on the same weights in the same lease: the checkpoint, bandwidth and
    quantized model are the first driver's (waited for, never rebuilt); every probe holds the host-wide lock."""
    first = fake_driver(tmp_path / "first", pipeline, ["awq-w4a16-g32-none"])
    second = steps.Driver(
        tmp_path / "second",
        ["awq-w4a16-g32-none"],
        pipeline,
        {"warmup": 1, "runs": 1, "share_state": str(tmp_path / "first"), "gpu_share": 0.2},
    )
    second.serve_cmd = first.serve_cmd
    second.record("environment", {"kind": "environment", "status": "ok", "gpu": {"name": "NVIDIA H200"}})
    (second.done / "environment").write_text("0\n")
    held = []
    real_lock = steps.Driver.probe_lock
    monkeypatch.setattr(records, "PROBE_LOCK", tmp_path / "probe.lock")

    def recording_lock(self):
        held.append(self.state.name)
        return real_lock(self)

    monkeypatch.setattr(steps.Driver, "probe_lock", recording_lock)
    second.run()
    results = tmp_path / "second" / "results"
    record = json.loads((results / "variant-awq-w4a16-g32-none.json").read_text())
    assert record["status"] == "ok", record.get("error")
    assert record["serve"]["gpu_memory_utilization"] == 0.2 and record["options"]["gpu_memory_utilization"] == 0.2
    assert json.loads((results / "bandwidth.json").read_text())["shared_from"] == str(tmp_path / "first")
    assert not (tmp_path / "second" / "weights").exists() and not any((tmp_path / "second" / "quant").iterdir())
    assert held == ["second"]  # the probe (bandwidth was taken, not measured)


def test_a_probe_waits_for_the_hosts_starting_servers_and_says_when_it_could_not(tmp_path, pipeline, monkeypatch):
    """A server starting on the host (any driver's marker, its driver alive) holds every probe back; a dead driver's
    marker does not; past QUIET_WAIT_S the probe runs and its record, and the committed one, say host_busy."""
    starting = tmp_path / "starting"
    starting.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (starting / f"{dead.pid}-gone-bf16").touch()
    d = fake_driver(tmp_path / "quiet", pipeline, ["awq-w4a16-g32-none"])
    assert d.wait_quiet() and not any(starting.iterdir())  # the dead driver's marker is dropped
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (starting / f"{sleeper.pid}-other-bf16").touch()
        monkeypatch.setattr(steps, "QUIET_WAIT_S", 0.5)
        d.run()
    finally:
        sleeper.kill()
    record = json.loads((tmp_path / "quiet" / "results" / "variant-awq-w4a16-g32-none.json").read_text())
    assert record["status"] == "ok" and record["host_busy"] is True
    assert [p.name for p in starting.iterdir()] == [f"{sleeper.pid}-other-bf16"]  # its own markers are gone
    written = collect.collect(tmp_path / "quiet" / "results.tar.gz", "host9", tmp_path / "records")
    kept = {p.name: json.loads(p.read_text()) for p in written}
    assert kept["host9-vllm0.26.0-awq-w4a16-g32-none.json"]["host_busy"] is True


def test_a_group_starts_only_when_the_host_has_room_and_each_record_counts_the_servers_resident_beside_it(
    tmp_path, pipeline, monkeypatch
):
    """--max-resident N: a group larger than N + 1 is refused before any step; a group waits, nothing of it started,
    while other drivers' servers leave it no room beside at most N others at a probe, and starts once they stop; each
    record says how many other servers were resident while it was probed (the most at the probe's start and end),
    and collect.py keeps that count."""
    with pytest.raises(plan.PlanError, match="--max-resident 0"):
        driver.main(["--variants", "bf16,awq-w4a16-g32-none", "--together", "2", "--max-resident", "0", "--plan"])
    resident = tmp_path / "resident"
    resident.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # another driver, alive
    try:
        (resident / f"{other.pid}-other-bf16").touch()
        alone = fake_driver(tmp_path / "alone", pipeline, ["bf16", "awq-w4a16-g32-none"], max_resident=0)
        held_back = []

        def other_server_stops(seconds):
            held_back.append(not list((tmp_path / "alone" / "results").glob("variant-*.json")))
            (resident / f"{other.pid}-other-bf16").unlink(missing_ok=True)

        alone.pause = other_server_stops
        alone.run()
        assert held_back == [True]  # the first group waited once, before any of its servers started
        results = tmp_path / "alone" / "results"
        for name in ("bf16", "awq-w4a16-g32-none"):
            record = json.loads((results / f"variant-{name}.json").read_text())
            assert (record["status"], record["resident_servers"]) == ("ok", 0), record.get("error")
        assert not any(resident.iterdir())  # its servers' markers went with them
        written = collect.collect(tmp_path / "alone" / "results.tar.gz", "host9", tmp_path / "records")
        assert {json.loads(p.read_text()).get("resident_servers") for p in written} == {0, None}  # None: environment

        real_probe = steps.probe

        def probe_while_another_server_starts(*args, **kwargs):
            (resident / f"{other.pid}-other-mtp2").touch()
            return real_probe(*args, **kwargs)

        monkeypatch.setattr(steps, "probe", probe_while_another_server_starts)
        pair = fake_driver(tmp_path / "pair", pipeline, ["bf16", "awq-w4a16-g32-none"], together=2, max_resident=2)
        pair.run()
        for name in ("bf16", "awq-w4a16-g32-none"):  # its group mate, and the other driver's server from mid-probe on
            record = json.loads((tmp_path / "pair" / "results" / f"variant-{name}.json").read_text())
            assert (record["status"], record["resident_servers"]) == ("ok", 2), record.get("error")
    finally:
        other.kill()


def ab_floor(variant: str, config: str, weights: str, logprobs_on: list) -> dict:
    """What gpu_proof/floor.py --ab writes: two passes of two prompt lengths, one profiled step each."""

    def passed(first_ms, logprobs, gdn_ms):
        lengths = {
            "64": {
                "first_step_ms": [first_ms],
                "first_step_median_ms": first_ms,
                "ids": [5, 6],
                "logprobs": logprobs,
                "step_median_ms": 3.5,
            },
            "2048": {
                "first_step_ms": [first_ms + 5],
                "first_step_median_ms": first_ms + 5,
                "ids": [7, 8],
                "logprobs": [-0.5, -0.25],
            },
        }
        profile = {"gdn_calls": 24, "gdn_host_ms_per_call": gdn_ms, "gpu_busy_ms": 5.0}
        return {"lengths": lengths, "profile": profile}

    off, on = passed(69.0, [-1.0, -2.0], 3.4), passed(20.0, logprobs_on, 0.4)
    same = {
        n: {"ids": True, "logprobs": off["lengths"][n]["logprobs"] == on["lengths"][n]["logprobs"]}
        for n in off["lengths"]
    }
    return {
        "kind": "floor",
        "status": "ok",
        "vllm": "0.32.0",
        "flags": [],
        "start_s": 60.0,
        "variant": variant,
        "config": config,
        "weights": weights,
        "tokens": 128,
        "options": {"gdn_prefill_backend": "triton"},
        "ab": "gdn_prefill_graphs",
        "passes": {"off": off, "on": on},
        "same": same,
        "step_median_ms": 3.5,
        "runs": 1,
    }


def test_an_in_process_ab_floor_is_kept_as_its_prefill_times_verdict_and_host_time(tmp_path, pipeline):
    """collect.py --floor: a floor.py --ab record made beside the driver keeps, per pass and prompt length, the first
    step's median, whether every token's id and logprob was equal, and the profiled step's GDN host time a call;
    never the ids, logprobs or the profiler's op list; its own variant, catalog and weights, the host's context."""
    d = fake_driver(tmp_path, pipeline, ["bf16"])
    d.run()
    floor = tmp_path / "tiny-ab.json"
    floor.write_text(json.dumps(ab_floor("tiny-awq-mtp2", "config/tiny.yaml", "trained", [-1.0, -2.5])))
    written = collect.collect(tmp_path / "results.tar.gz", "host1", tmp_path / "records", floors=[str(floor)])
    kept = json.loads((tmp_path / "records" / "h200" / "host1-vllm0.26.0-floor-tiny-ab.json").read_text())
    assert any(p.name.endswith("floor-tiny-ab.json") for p in written)
    assert (kept["variant"], kept["config"], kept["weights"], kept["ab"]) == (
        "tiny-awq-mtp2",
        "config/tiny.yaml",
        "trained",
        "gdn_prefill_graphs",
    )
    assert kept["prefill_ms"] == {"off": {"64": 69.0, "2048": 74.0}, "on": {"64": 20.0, "2048": 25.0}}
    assert kept["same"] == {"64": False, "2048": True}  # a logprob moved at 64 tokens
    assert kept["profile"]["on"] == {"gdn_calls": 24, "gdn_host_ms_per_call": 0.4, "gpu_busy_ms": 5.0}
    assert "logprobs" not in json.dumps(kept) and "ids" not in json.dumps(kept)


def test_a_lease_that_ran_only_floors_is_collected_from_the_floors_own_environment(tmp_path):
    """collect.py - HOST --floor ...: no driver's results; each floor's GPU, CPU and date from its own record (what
    floor.py records), else from --gpu/--cpu/--date, and a floor without either is refused naming what is missing."""
    floor = ab_floor("tiny-awq-mtp2", "config/tiny.yaml", "trained", [-1.0, -2.5])
    recorded = tmp_path / "recorded.json"
    recorded.write_text(
        json.dumps(floor | {"environment": {"gpu": "NVIDIA H200", "cpu": "Xeon", "date": "2026-12-02"}})
    )
    written = collect.collect(None, "host9", tmp_path / "records", floors=[str(recorded)])
    assert sorted(p.name for p in written) == [
        "host9-vllm0.32.0-environment.json",
        "host9-vllm0.32.0-floor-recorded.json",
    ]
    kept = json.loads((tmp_path / "records" / "h200" / "host9-vllm0.32.0-floor-recorded.json").read_text())
    assert (kept["gpu"], kept["date"], kept["engine"], kept["weights"]) == (
        "NVIDIA H200",
        "2026-12-02",
        "0.32.0",
        "trained",
    )
    environment = json.loads(next(p for p in written if p.name.endswith("environment.json")).read_text())
    assert (environment["cpu"], environment["copy_gbps"]) == ("Xeon", None)
    older = tmp_path / "older.json"
    older.write_text(json.dumps(floor))
    with pytest.raises(SystemExit, match="cpu"):
        collect.collect(
            None, "host9", tmp_path / "other", floors=[str(older)], given={"gpu": "NVIDIA H200", "date": "2026-12-02"}
        )
    given = {"gpu": "NVIDIA H100 80GB HBM3", "cpu": "EPYC", "date": "2026-12-02"}
    collect.collect(None, "host9", tmp_path / "other", floors=[str(older)], given=given)
    assert (tmp_path / "other" / "h100" / "host9-vllm0.32.0-floor-older.json").is_file()


def test_alone_probes_one_server_again_once_its_group_is_stopped_and_the_tables_show_both(tmp_path, pipeline):
    """--alone: after its group's probes, bf16's server is probed again with the group's other server stopped, so
    its record holds the same variant beside one resident server and beside none; collect keeps both, the results
    page shows them side by side; two --alone variants in one group, or one with nobody beside it, are refused."""
    import render_results

    names = ["bf16", "awq-w4a16-g32-none"]
    d = fake_driver(tmp_path, pipeline, names, together=2, alone=["bf16"])
    d.run()
    record = json.loads((tmp_path / "results" / "variant-bf16.json").read_text())
    assert record["status"] == "ok", record.get("error")
    assert (record["resident_servers"], record["alone"]["resident_servers"]) == (1, 0)
    assert record["alone"]["probe"]["categories"] and "alone" not in json.loads(
        (tmp_path / "results" / "variant-awq-w4a16-g32-none.json").read_text()
    )
    written = collect.collect(tmp_path / "results.tar.gz", "host1", tmp_path / "records")
    kept = next(json.loads(p.read_text()) for p in written if p.name.endswith("-bf16.json"))
    assert kept["alone"]["resident_servers"] == 0 and set(kept["alone"]["sets"]) == set(kept["sets"])
    rows = render_results.resident_rows([kept], kept["gpu"])
    assert len([row for row in rows if row.startswith("| `bf16`")]) == 1
    assert "| 1 → 0 |" in rows[-1]
    with pytest.raises(plan.PlanError, match="share serve-1"):
        driver.main(["--variants", "bf16,awq-w4a16-g32-none", "--together", "2", "--alone", "bf16,awq-w4a16-g32-none"])
    with pytest.raises(plan.PlanError, match="nothing is resident"):
        driver.main(["--variants", "bf16", "--alone", "bf16", "--plan"])
