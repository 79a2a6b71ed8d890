import json
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(0, str(Path(workflow.basedir) / "scripts"))
from lib.dag import config as pipeline_config  # every check and derivation, unit-tested in tests/unit/test_config.py
from lib.dag import lock as pipeline_lock  # what each floating name resolved to (config/lock/), tests/unit/test_lock.py
from lib.dag import selection  # select's ranking and walk (rules/select.smk), unit-tested in tests/unit/test_sweeps.py

# Schema (naming every bad key), cross-field and file checks, sweep expansion: before any job runs.
try:
    PIPELINE = pipeline_config.load(config, Path(workflow.basedir))
except pipeline_config.ConfigError as error:
    raise WorkflowError(str(error))
config = PIPELINE.config  # defaults filled, sweeps expanded

RECIPES, COMPARED, FIXED = PIPELINE.recipes, PIPELINE.compared, PIPELINE.fixed
# select.mode fastest: the variants ranked and checked for image.tar.gz (rules/rank_candidates.smk, rules/select.smk)
CANDIDATES = PIPELINE.candidates
# The same-host bf16 variant the ranking's speedups are against, when the run measures one (else baseline_ms).
BF16_REFERENCE = PIPELINE.bf16_reference
MODEL_DIR = f"weights/{config['model']['name']}"
LOCAL_BASE = config["image"]["base"] == "local"
# What bake_compile_cache and build_image start from: the tiny profile's local build, or the registry base pulled at
# the digest its lock entry holds.
BASE_RECORD = "results/base_image/image.json" if LOCAL_BASE else "results/pull_base/image.json"
# Each fetch's lock entries, inputs of its rule: an entry changed since (a refresh) refetches (scripts/lib/dag/lock.py).
LOCK_ENTRIES = {
    fetch: pipeline_lock.entry_inputs(config, fetch, workflow.basedir) for fetch in ("calibration", "gate", "base")
}
SYNTHETIC = config["model"]["source"] == "synthetic"
TINY_TRAIN = config["model"]["tiny"]["train"]
TRAINED = SYNTHETIC and TINY_TRAIN["steps"] > 0
TASKS_DIR = config["quality"]["tasks_dir"]
REFERENCE_VARIANT = config["quality"]["reference_variant"]
# Repairs each venv needs after `pip install` (see scripts/make_venv.py).
VENV_REPAIRS = {"serve-cpu": ["drop_cuda_media", "guard_torchvision"]}
# Each rule's memory and wall-clock limit (`resources` in the config: what a cluster executor asks for).
RESOURCES = config["resources"]
# Every rule that runs the model asks for a GPU in the real profile (the SLURM executor reads `gpu`).
GPU = 1 if config["image"]["gpus"] else 0
# A host's share each model-running job takes (percent): the latency probe takes it all, so no timing runs
# beside another job. A global resource nobody sets is unlimited, so one host is the default here;
# profiles/slurm raises it (every serving job has its own node there).
if "host_share" not in workflow.global_resources:
    workflow.register_resource("host_share", 100)
# Image writes into a host's container store, one at a time: handing a built image to Docker stages the whole
# image (~6 GB for the tiny one) as a temporary archive, and two at once filled a CI machine's disk.
if "image_writes" not in workflow.global_resources:
    workflow.register_resource("image_writes", 1)


project_files = pipeline_config.project_files
SERVING_FILES = project_files("serving")
# Where a stage script's project imports live (scripts/lib/__init__.py puts the root on sys.path for `serving`).
PROJECT_PACKAGES = {"lib": "scripts/lib", "serving": "serving"}


def code_of(script):
    """The project modules `script` imports, read from its import graph, and the data files they declare
    (scripts/lib/dag/imports.py): inputs of the rule that runs it, so a change to shared code or to a file it reads
    reruns exactly the stages that import it."""
    from lib.dag.imports import code_inputs

    return [str(path) for path in code_inputs(script, PROJECT_PACKAGES)]


def tiny_training_inputs():
    return pipeline_config.tiny_training_inputs(TINY_TRAIN, TASKS_DIR)


wildcard_constraints:
    variant="|".join(re.escape(name) for name in sorted(config["variants"])),
    recipe="|".join(re.escape(stem) for stem in sorted(RECIPES)),
    env="[a-z0-9-]+",


def venv(kind):
    """Readiness marker of the venv used for a kind of stage (compress, serve, eval)."""
    return f".venvs/{config['envs'][kind]}/pip-freeze.txt"


def optional(condition, path):
    """An input that only some profiles have (an empty named input otherwise)."""
    return path if condition else []


def variant_config(wildcards):
    return config["variants"][wildcards.variant]

recipe_key = PIPELINE.recipe_key
DRAFTS = PIPELINE.drafts


def draft_input(wildcards):
    """A drafted variant's drafter checkpoint (rule download_draft); nothing for the others."""
    folder = PIPELINE.draft_folder(wildcards.variant)
    return f"weights/drafts/{folder}/checkpoint" if folder else []


def draft_manifest(wildcards):
    folder = PIPELINE.draft_folder(wildcards.variant)
    return f"weights/drafts/{folder}/manifest.json" if folder else []


def quantized(output):
    """Input function: the variant's quantize output (shared by every variant with the same recipe)."""
    return lambda wildcards: f"results/quantize/{recipe_key(wildcards.variant)}/{output}"


def reference_scores(wildcards):
    """Where the reference variant's quality.json would be (the gate reads it if it is there by then): the same
    string whether or not it exists yet, so its appearance never reruns a gate. Recovery is reported, never gated."""
    if REFERENCE_VARIANT and wildcards.variant != REFERENCE_VARIANT:
        return f"results/{REFERENCE_VARIANT}/quality_gate/quality.json"
    return None


def selected_variant():
    """The variant image.tar.gz is made of: fixed in config, or what the `select` checkpoint chose."""
    if FIXED:
        return PIPELINE.fixed_variant
    return json.loads(Path(checkpoints.select.get().output.selection).read_text())["variant"]


def selected(path):
    """Input function: a file of the selected variant, results/<variant>/<path>."""
    return lambda wildcards: f"results/{selected_variant()}/{path}"


def selected_image_record(wildcards):
    """The build record of the variant in image.tar.gz; any other variant's verify.json is refused."""
    if wildcards.variant != selected_variant():
        raise WorkflowError(
            f"image.tar.gz holds variant {selected_variant()!r}, not {wildcards.variant!r}: "
            f"ask for results/{selected_variant()}/verify_image/verify.json"
        )
    return f"results/{wildcards.variant}/build_image/image.json"

