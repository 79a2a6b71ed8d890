"""The config schema rejects bad configs before any job runs, naming the offending key."""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import ROOT, TINY, snakemake


def tiny_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())


def dry_run_with(tmp_path: Path, config: dict):
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(config))
    return snakemake("-n", "image.tar.gz", *TINY, str(override), check=False)


@pytest.mark.parametrize("mutate, key, words", [
    (lambda c: c.update(typo_key=1), "typo_key", "unknown key"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["speculative"].update(k=-1), "variants.tiny-awq-mtp1.speculative.k",
     "less than the minimum"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["serve"].update(max_num_seqs="eight"),
     "variants.tiny-awq-mtp1.serve.max_num_seqs", "is not of type 'integer'"),
    (lambda c: c["image"].update(max_size_gb=0), "image.max_size_gb", "less than or equal to the minimum"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["serve"].update(max_num_sqs=4), "variants.tiny-awq-mtp1.serve.max_num_sqs",
     "unknown key"),
    (lambda c: c.update(variant="nope"), "variant", "is not one of the variants"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["serve"].update(enable_prefix_caching=True),
     "variants.tiny-awq-mtp1.serve.enable_prefix_caching", "speculative decoding with prefix caching"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["speculative"].update(k=0), "variants.tiny-awq-mtp1.speculative.k",
     "method mtp needs k >= 1"),
    (lambda c: c["variants"]["tiny-awq-mtp1"].update(speculative={"method": "none", "k": 3}),
     "variants.tiny-awq-mtp1.speculative.k", "without a speculative method"),
    (lambda c: c["image"].update(base="vllm/vllm-openai:v0.26.0"), "image.base", "is not pinned by digest"),
    (lambda c: c["image"].update(base="vllm/vllm-openai:v0.26.0@sha256:abc"), "image.base", "allow_unpinned_base: true"),
    (lambda c: c["image"].update(verify_run="sometimes"), "image.verify_run", "is not one of ['auto', 'always', 'never']"),
    (lambda c: c["variants"]["tiny-awq-mtp1"].update(speculative={"method": "draft_model", "k": 3}),
     "variants.tiny-awq-mtp1.speculative.model", "goes with method draft_model"),
    (lambda c: c["variants"]["tiny-awq-mtp1"]["speculative"].update(model="/opt/ml/draft"),
     "variants.tiny-awq-mtp1.speculative.model", "only with it"),
    (lambda c: (c["image"].update(gpu_arch="sm_86"), c["variants"]["tiny-awq-mtp1"]["serve"].update(kv_cache_dtype="fp8")),
     "variants.tiny-awq-mtp1.serve.kv_cache_dtype", "needs FP8 support (sm_89 or newer)"),
    (lambda c: c["image"].update(gpu_arch="H100"), "image.gpu_arch", "does not match"),
])
def test_bad_config_is_rejected_naming_the_key(tmp_path, mutate, key, words):
    config = tiny_config()
    mutate(config)
    result = dry_run_with(tmp_path, config)
    assert result.returncode != 0
    assert f"config key '{key}'" in result.stderr + result.stdout
    assert words in result.stderr + result.stdout
    assert "Job stats" not in result.stdout  # rejected before the DAG was even built


def test_both_profiles_validate():
    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    real = yaml.safe_load((ROOT / "config.yaml").read_text())
    merged = copy.deepcopy(real)
    for key, value in tiny_config().items():  # Snakemake merges --configfile over config.yaml the same way
        merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    jsonschema.Draft202012Validator(schema).validate(real)
    jsonschema.Draft202012Validator(schema).validate(merged)


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


def test_the_real_profile_base_is_pinned_by_digest():
    base = yaml.safe_load((ROOT / "config.yaml").read_text())["image"]["base"]
    assert re.fullmatch(r"docker\.io/vllm/vllm-openai:v[\d.]+@sha256:[0-9a-f]{64}", base), base


@pytest.mark.parametrize("base", ["vllm/vllm-openai:v0.26.0", "registry.example/vllm:latest"])
def test_an_unpinned_base_passes_only_when_allowed(tmp_path, base):
    config = tiny_config()
    config["image"].update(base=base, allow_unpinned_base=True)
    result = dry_run_with(tmp_path, config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "not pinned by digest" not in result.stdout + result.stderr
