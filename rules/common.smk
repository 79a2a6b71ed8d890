import copy
import hashlib
import json
import os
import re
from pathlib import Path

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

CONFIG_SCHEMA = str(Path(workflow.basedir) / "schemas" / "config.schema.yaml")


def check_config(config, schema_path=CONFIG_SCHEMA):
    """Reject a bad config before any job runs, naming every offending key (jsonschema alone names few)."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    lines = []
    for error in jsonschema.Draft202012Validator(schema).iter_errors(config):
        path = [str(part) for part in error.absolute_path]
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            known = error.schema.get("properties", {})
            lines += [f"config key '{'.'.join(path + [k])}': unknown key" for k in error.instance if k not in known]
        else:
            lines.append(f"config key '{'.'.join(path) or '(top level)'}': {error.message}")
    if lines:
        raise WorkflowError(f"invalid configuration ({schema_path}):\n  " + "\n  ".join(sorted(lines)))


check_config(config)
validate(config, CONFIG_SCHEMA, set_default=True)
config = copy.deepcopy(config)  # defaults were set from shared schema objects


def combination_problems(variants, gpu_arch=None):
    """Settings each valid alone that vLLM cannot serve together: refused now, not after a long build."""
    problems = []
    capability = int(gpu_arch[len("sm_"):]) if gpu_arch else None
    for name, variant in variants.items():
        serve, speculative = variant["serve"], variant["speculative"]
        key = f"config key 'variants.{name}"
        if speculative["method"] != "none" and speculative["k"] < 1:
            problems.append(f"{key}.speculative.k': method {speculative['method']} needs k >= 1")
        if speculative["method"] == "none" and speculative["k"] != 0:
            problems.append(f"{key}.speculative.k': k={speculative['k']} without a speculative method")
        if speculative["method"] != "none" and serve["enable_prefix_caching"]:
            problems.append(f"{key}.serve.enable_prefix_caching': speculative decoding with prefix caching kills "
                            "vLLM's engine on Qwen3.5 (and needs Triton on CPU); set it to false")
        if (speculative["method"] == "draft_model") != bool(speculative["model"]):
            problems.append(f"{key}.speculative.model': a draft model directory goes with method draft_model, "
                            "and only with it")
        if capability is not None and capability < 89 and serve["kv_cache_dtype"].startswith("fp8"):
            problems.append(f"{key}.serve.kv_cache_dtype': {serve['kv_cache_dtype']} needs FP8 support "
                            f"(sm_89 or newer); image.gpu_arch is {gpu_arch}")
    return problems


def base_problems(image):
    """A registry base must be pinned by digest (a tag can move under the same config) unless opted out."""
    base = image["base"]
    if base == "local" or image["allow_unpinned_base"] or re.search(r"@sha256:[0-9a-f]{64}$", base):
        return []
    return [f"config key 'image.base': {base!r} is not pinned by digest; write it as "
            f"{base.split('@')[0]}@sha256:<digest> (after `docker pull`, `docker inspect -f "
            "'{{index .RepoDigests 0}}'` prints it), or set image.allow_unpinned_base: true to accept a movable tag"]


COMBINATION_PROBLEMS = (combination_problems(config["variants"], config["image"]["gpu_arch"])
                        + base_problems(config["image"]))
if COMBINATION_PROBLEMS:
    raise WorkflowError("invalid configuration:\n  " + "\n  ".join(COMBINATION_PROBLEMS))
if config["variant"] not in config["variants"]:
    raise WorkflowError(
        f"invalid configuration: config key 'variant': {config['variant']!r} is not one of the variants "
        f"{sorted(config['variants'])}"
    )

MODEL_DIR = f"weights/{config['model']['name']}"
LOCAL_BASE = config["image"]["base"] == "local"


def project_files(folder):
    """Files under a project folder as inputs; bytecode caches come and go and must not trigger reruns."""
    return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)


SERVING_FILES = project_files("serving")
# Repairs each venv needs after `pip install` (see scripts/make_venv.py).
VENV_REPAIRS = {"serve-cpu": ["drop_cuda_media", "guard_torchvision"]}


wildcard_constraints:
    variant="|".join(sorted(config["variants"])),
    env="[a-z0-9-]+",


def venv(kind):
    """Readiness marker of the venv used for a kind of stage (compress, serve, eval)."""
    return f".venvs/{config['envs'][kind]}/pip-freeze.txt"


def optional(condition, path):
    """An input that only some profiles have (an empty named input otherwise)."""
    return path if condition else []


def variant_config(wildcards):
    return config["variants"][wildcards.variant]


def serve_settings(wildcards):
    """Everything the serving entrypoint needs, as it is written to serve.json inside the image."""
    variant = variant_config(wildcards)
    speculative = variant["speculative"]
    return dict(
        variant["serve"],
        speculative={"method": speculative["method"], "num_speculative_tokens": speculative["k"],
                     **({"model": speculative["model"]} if speculative["model"] else {})},
    )


def image_ref(variant):
    return f"docker.io/library/{config['image']['name']}:{variant}"


def run_settings():
    """How a built image is started, for every stage that runs it."""
    image = config["image"]
    return {"gpus": image["gpus"], "shm_size": image["shm_size"], "ping_timeout_s": image["ping_timeout_s"]}


def variant_sha256(variant):
    """sha256 of the variant's resolved settings (schema defaults filled in) as canonical JSON: the config label."""
    text = json.dumps(config["variants"][variant], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def provenance(wildcards):
    """Config-derived label values (scripts/build_image.py hashes the input files itself)."""
    model = config["model"]
    return {
        "title": config["image"]["name"],
        "variant": wildcards.variant,
        "config_sha256": variant_sha256(wildcards.variant),
        "weights_revision": model["revision"] if model["source"] == "hub" else "synthetic",
        "build_date": config["image"]["label_build_date"],
    }


SYNTHETIC = config["model"]["source"] == "synthetic"
TINY_TRAIN = config["model"]["tiny"]["train"]
TRAINED = SYNTHETIC and TINY_TRAIN["steps"] > 0


def tiny_training_inputs():
    """The generator of the tiny model's training conversations and the test splits it keeps out of them."""
    generator = Path(TINY_TRAIN["generator"])
    return {"generator": str(generator), "test_splits": sorted(str(p) for p in generator.parent.glob("*.test.jsonl"))}


TASKS_DIR = config["quality"]["tasks_dir"]
REFERENCE_VARIANT = config["quality"]["reference_variant"]
if REFERENCE_VARIANT is not None and REFERENCE_VARIANT not in config["variants"]:
    raise WorkflowError(f"invalid configuration: config key 'quality.reference_variant': {REFERENCE_VARIANT!r} is "
                        f"not one of the variants {sorted(config['variants'])}")


def reference_scores(wildcards):
    """The reference variant's quality.json when it is already there (a run that gated it first); recovery is
    reported, never gated, so its absence does not force the reference's whole build."""
    path = f"results/{REFERENCE_VARIANT}/quality_gate/quality.json"
    if REFERENCE_VARIANT and wildcards.variant != REFERENCE_VARIANT and Path(path).is_file():
        return path
    return []
